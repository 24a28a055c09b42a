"""CDP's clock (Fournier & Oyallon 2024; design.md section 6): when each worker runs each stage op,
and at which op each message is received and each send waited for, worked out alike on every rank.

**The schedule.** N workers, L stages; a step is 2L stage ops (forward 0..L-1, then backward
L-1..0). Worker n's op j of step k, global index phi = 2Lk + j, is due at time phi + n*delta,
delta = 2L/N time units (the paper's uniform delay): its forward of stage l at 2Lk + n*delta + l,
its backward at 2Lk + n*delta + 2L-1-l. Times are counted in ticks, s = N / gcd(2L, N) to a time
unit, so every due time is a whole tick.

**Enforced by tokens.** After each op a worker sends its successor a token (8 bytes); before op
phi, worker n receives its predecessor's tokens up to the last op due to end by phi's due time:
index phi - 1 + floor(2L/N) (worker 0 follows worker N-1 one step behind: 2L less). No worker
starts an op before its predecessor has done what the schedule puts before it.

**Messages at op boundaries.** Each piece of a stage's gradient buffer (a stage is cut into
pieces where that evens the ranks' bytes: :class:`planner.stages.Units`) is summed along a chain
ending at the piece's owner and passed back around the ring (runtime.cdp); a piece's messages
leave at the same ops as its stage's. Every blocking wait of a rank happens
just before one of its ops ("at op phi"), and only for something attached to an op of another
rank that ends no later than phi starts (on this clock): a message sent at or after that op, a
receive posted there (a send's completion, which on gloo needs the receiver's receive). Start
times are strictly earlier along every such dependency, so the waits cannot form a cycle. The
clock simulates the schedule in start-time order (an op starts at its due time, or later when
what it must wait for ends later: a rule's update whose ring has not come round, the stretch
``sync`` needs) and receives each message at the first op of its receiver that starts after the
message's op ends and where it can be taken (a chain's partial sum after the receiver's own
backward of the stage; a ring's copy after the receiver's chain send completed, since it arrives
in the same buffer): there its receive is posted, and the message is taken (waited for) at once,
except the ring copies a worker applies at a step's start (v1's), taken an op later where that
keeps the schedule (:func:`ring_hold`), travelling
while the receiver computes; a send is waited for at the first op of its sender that starts
after its receiver took it.

**Updates** (theta(t) the parameters step t computes with, g(t) step t's summed gradient):
``sync`` applies g(t) at step t+1's start; ``v1`` at step t+2's start; ``v2`` (always the star,
below) just before step t+1's forward of stage l where the worker is fresh on l
(l >= (N-1-n) L / N), and otherwise just before step t+2's (the worker computes step t+1 with
theta_l(t) there, the paper's second version, and needs no copy of it: the update waits). At a
step's start the previous step's activations are gone, so the optimizer's temporaries meet none,
as in data parallelism.

**The star** (``star=True``: CDP with ZeRO-2 and 3, and under v2 whatever the ZeRO stage,
:func:`star_messages`): no chain and no ring. After its backward of a stage
a worker sends each piece's gradient to the piece's owner ("reduce"), which takes it at its next
op boundary once it has begun that step; with all N contributions (its own at its backward) the
sum is final and the owner sends the new parameters to each other worker ("deliver"). A worker
posts the delivery's receive once its last use of the old parameters (its backward of the stage in
the step before the first that uses them) has ended, and takes it an op later or just before that
step's forward of the stage, where every rule's update is applied under the star (the owner's
optimizer has already stepped; what is left is a copy). A sum is final two messages after the last
worker's backward whoever owns it, so v2 keeps the balanced owners where N > L too. With ZeRO-0
(``replicated``) the delivery is the sum itself, received into a buffer of its own that the worker
keeps until its update, where its own optimizer steps with it. The clock counts what each rank
holds at each step's start (:attr:`Clock.live`): the sums it owns not yet installed and taken by
every worker, its stage buffers whose reduces are not all taken, and (ZeRO-0) the sums it has
posted receives for and not yet applied.

**Fetch** (CDP with ZeRO-3, ``fetch=True``, a star): no install; an owner keeps each version of
its pieces (the first; then each sum once final) and queues, for each step that computes with it
on each other worker and each op of that step that reads its stage (``reads``: a tied weight's
later readers), a "fetch" (before the forward) and a "refetch" (before the backward), sent once the
owner has begun the step before. The receiver posts it at the boundary before the op unless that
op reads the same stage (then at the op's), and takes it just before the op; an op starts only
once it has every piece of every stage it reads (its own: the version made). A version lives
until its fetches are taken and its owner's own ops with it have run (:attr:`Clock.live`).

Every rank runs the same simulation, so each knows, for each of its ops, which tokens to take,
which messages to receive, which sends to wait for and which stage updates to apply
(:meth:`Clock.actions`).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from planner.stages import Units, message_units, stage_owners

TOKEN_BYTES = 8
# a buffer the star keeps: ("sum", step, stage, piece) on its owner, ("grads", worker, step, stage), and with ZeRO-0
# ("got", worker, step, unit) a sum a worker received and keeps until its update
Held = tuple[str, int, int, int]


def star_messages(rule: str, zero_stage: int) -> bool:
    """Whether CDP's messages run as the star (module docstring) rather than the chain and ring:
    with ZeRO-2 and 3, and under ``v2`` whatever the ZeRO stage. Under v2 a worker fresh on a
    stage needs the sum before its next forward of it, and the ring's N-1 hops from the owner do
    not always come round in time with owners that even the ranks' bytes: where N > L (N = 8,
    L = 4) and with ZeRO-1 at N = L = 8 only every chain ending at worker N-1 kept the schedule,
    one rank owning every piece (twice the others' bytes sent; with ZeRO-1 all the optimizer
    state on it). The star's sum is final two messages after the last backward whoever owns it.
    With ZeRO-1 the star is ZeRO-2's (no rank keeps a gradient buffer once its pieces have left);
    with ZeRO-0 the owner sends back the sum and every worker steps its own optimizer with it
    (``replicated``). v1 (and sync) keep the chain and ring: balanced there, and its sends spread
    more evenly over the step than the star's deliveries, which leave together."""
    return zero_stage >= 2 or rule == "v2"


def op_stage(op: int, stages: int) -> tuple[int, str]:
    """The stage op ``op`` computes and its fetch kind: "fetch" for a forward, "refetch" for a backward."""
    j = op % (2 * stages)
    return (j, "fetch") if j < stages else (2 * stages - 1 - j, "refetch")


def readers_of(stage: int, reads: Sequence[Collection[int]] | None) -> list[int]:
    """The stages whose ops read ``stage``'s parameters: itself and those whose ``reads`` name it."""
    return [stage, *(j for j, r in enumerate(reads or ()) if stage in r and j != stage)]


@dataclass(frozen=True, order=True)
class Message:
    """A point-to-point message of the schedule. ``kind`` "chain": the partial sum of piece
    ``part`` of stage ``stage``'s gradient of step ``step`` from chain place ``place`` to place + 1;
    "ring": the piece's final buffer (sum, or with ZeRO the owner's new parameters) from ring place
    ``place`` to place + 1 (place 0 is the owner); with ``star`` (ZeRO-2), "reduce": worker
    ``src``'s own gradient of the piece to its owner ``dst`` (``place``: the sender's place after
    the owner, 0 to N-2) and "deliver": the owner's new parameters of the piece to worker ``dst``
    (``place``: the receiver's); with ``fetch`` (ZeRO-3), "fetch" and "refetch": the owner's
    piece of stage ``stage``'s parameters in the version worker ``dst`` computes with, before its
    forward (backward) of stage ``at`` of step ``step`` (``at`` is ``stage``, or a later stage that
    reads them: a tied weight); "token": worker ``src`` has done op ``step``."""

    step: int
    stage: int
    kind: str
    place: int
    src: int
    dst: int
    part: int = 0
    at: int = -1


@dataclass
class OpActions:
    """What worker ``worker`` does just before its op ``op`` and when it starts on the clock (ticks)."""

    worker: int
    op: int
    start: int
    # in order, each at a tick <= start: ("post", message, tick) post its receive (it travels
    # while this worker computes), ("recv", message, tick) wait for it (an op after the post at
    # the earliest) and pass on what ``forwards`` says, ("wait", message, tick) wait for this send
    # to complete, ("tokens", k, tick) receive the predecessor's tokens up to op k, ("send", message,
    # tick) send it (fetch: a version, from its owner, once the owner has begun the step before its use)
    log: list[tuple[str, Message | int, int]] = field(default_factory=list)
    uses: list[tuple[int, int]] = field(default_factory=list)  # (step, stage) updates applied, after the log
    forwards: dict[Message, Message] = field(default_factory=dict)  # a receive -> the message it sends on, at once
    log_order: list[int] = field(default_factory=list)  # each log entry's place in the simulation's order
    order: int = -1  # the op's place in it
    heads: list[Message] = field(default_factory=list)  # after the op (a backward): the chains this worker heads (star: its reduces, deliveries)
    delivers: dict[Message, list[Message]] = field(default_factory=dict)  # star: a reduce that completes a sum -> the owner's deliveries

    @property
    def sends(self) -> list[Message]:
        """The data messages this op sends, in order: those its receives pass on (or, star, the
        deliveries a completed sum sends) and, fetch, the versions it sends, then its chains' heads."""
        out: list[Message] = []
        for kind, item, _ in self.log:
            if kind == "recv" and isinstance(item, Message):
                out += [self.forwards[item]] if item in self.forwards else []
                out += self.delivers.get(item, [])
            elif kind == "send" and isinstance(item, Message):
                out.append(item)
        return out + self.heads


@dataclass
class _Msg:
    message: Message
    avail: int  # the tick it is sent at (after an op: the op's end); the receiver may post its receive from then
    posted: int = -1  # the tick the receiver posted its receive at (it takes the message then, or an op later: Clock._hold)
    recv_end: int = -1  # the tick the receiver took it at (the sender may wait for the send from then)


class Clock:
    """CDP's schedule for ``workers`` workers and ``stages`` stages (module docstring)."""

    def __init__(self, workers: int, stages: int, owners: Sequence[int], rule: str, has_params: Sequence[bool], keep: int | None = None,
                 hold: bool = False, parts: Sequence[int] | None = None, star: bool = False, fetch: bool = False,
                 reads: Sequence[Sequence[int]] | None = None, replicated: bool = False) -> None:
        """``owners``: each unit's owner, a stage's pieces in order (``parts``: each stage's piece
        count, 1 by default; :class:`planner.stages.Units`). ``keep``: the worker whose ops'
        actions are kept for :meth:`actions` (None: every worker's). ``hold``: the ring copies a
        worker applies at a step's start (v1's) are taken an op after their receive is posted
        (:func:`ring_hold`). ``star`` (CDP with ZeRO-2 and 3, and v2: :func:`star_messages`):
        no chain and no ring; each worker sends its gradient of a piece straight to the piece's
        owner after its backward of the stage (taken at the owner's next op boundary, summed
        there), and the owner, once it has every worker's, sends its new parameters straight to
        each worker, which takes them at the op its update is due at (module docstring). ``fetch``
        (CDP with ZeRO-3, a star): a worker holds no piece it does not own between its ops; each
        owner keeps its pieces' versions and sends each worker the version it computes with just
        before its forward and again before its backward of the stage (module docstring).
        ``reads``: for each stage, the other stages whose parameters its ops read (a weight tied
        across stages belongs to the earliest that reads it); fetch sends those too. ``replicated``
        (the star with ZeRO-0): a delivery is the piece's sum, which its receiver keeps from the
        post of its receive until its update (counted in :attr:`live`)."""
        if rule not in ("sync", "v1", "v2"):
            raise ValueError(f"unknown CDP update rule {rule!r}; use sync, v1 or v2")
        if rule == "v2" and not (star or fetch) and workers > 1:
            raise ValueError("CDP v2 runs as the star (planner.cdp_clock.star_messages): pass star=True")
        self.parts = tuple(parts) if parts is not None else (1,) * stages
        if len(self.parts) != stages or len(owners) != sum(self.parts) or len(has_params) != stages:
            raise ValueError(f"{stages} stages of {sum(self.parts)} pieces need {sum(self.parts)} owners and {stages} flags, "
                             f"got {len(owners)} and {len(has_params)}")
        self._first = [sum(self.parts[:stage]) for stage in range(stages)]
        self.workers, self.stages, self.owners, self.rule = workers, stages, tuple(owners), rule
        self.has_params = tuple(has_params)
        self.star = star or fetch
        self.fetch = fetch
        self.replicated = replicated and self.star and not fetch
        self.reads = tuple(frozenset(r) for r in reads) if reads is not None else (frozenset(),) * stages
        if rule == "sync":  # every stage's sum before the next step's forward: no delay (DP through the chain)
            self.scale, self.delta, self.lead = 1, 0, 0
        else:
            self.scale = workers // math.gcd(2 * stages, workers)  # ticks per time unit
            self.delta = 2 * stages * self.scale // workers  # the uniform delay, in ticks
            self.lead = 2 * stages // workers  # ops a worker's predecessor is ahead by, whole
        self.period = 2 * stages
        self._order = 0  # every action and op numbered in the order the simulation does them
        self.hold = self.scale if hold and rule == "v1" and not star else 0  # ticks between posting a v1 ring copy's receive and taking it
        self._start: dict[tuple[int, int], int] = {}
        self._done: dict[tuple[int, int], OpActions] = {}
        self._queue: list[tuple[int, int, int, int]] = []
        self._seq = 0
        self._parked: set[int] = set()
        self._boundary = {n: _Boundary(0, self.due(n, 0), OpActions(n, 0, -1)) for n in range(workers)}
        for n in range(workers):
            self._push(n, self.due(n, 0))
        self._msgs: dict[Message, _Msg] = {}
        self._incoming: list[list[Message]] = [[] for _ in range(workers)]  # created, not yet received
        self._outgoing: list[list[Message]] = [[] for _ in range(workers)]  # sent, not yet waited for
        self._final: dict[tuple[int, int, int, int], int] = {}  # (worker, step, stage, part) -> op its piece became final at
        self._chain_done: set[tuple[int, int, int, int]] = set()  # (worker, step, stage, part): its chain send waited for
        self._summed: dict[tuple[int, int, int], int] = {}  # star: (step, stage, part) -> contributions its owner has (its own included)
        # star: what keeps each buffer alive: ("sum", step, stage, part) an owner's sum (its install and its
        # deliveries), ("grads", worker, step, stage) a worker's stage buffer (its reduces' sends)
        self._refs: dict[Held, int] = {}
        self.live: dict[tuple[int, int], tuple[Held, ...]] = {}  # star: (worker, op at a step's start) -> the buffers alive
        self._tokens_taken = [-1] * workers
        self.keep = keep
        # a piece's gradient to its owner, back (ZeRO-2) or, fetch, to each op that reads it
        per_piece = [1 + 2 * len(self.readers(stage)) if fetch else 2 for stage in range(stages)]
        self.messages_per_step = (workers - 1) * sum(p * k for p, k, has in zip(self.parts, per_piece, has_params, strict=True) if has)
        self._closed: dict[int, int] = {}  # step -> its data messages received and waited for
        self._touched: dict[int, int] = {}  # step -> the last op index any of its messages was received or waited for at
        self._fetched: set[tuple[int, int, int, int, str, int]] = set()  # fetch: (worker, step, stage, piece, kind, at) taken
        self._queued: list[list[Message]] = [[] for _ in range(workers)]  # fetch: versions made, each sent from the step before its use
        if fetch and workers > 1:
            for stage in range(stages):
                for part in range(self.parts[stage]):
                    if self.has_params[stage]:
                        self._refs[("sum", -1, stage, part)] = 0
                        self._versions(self.owner(stage, part), -1, stage, part)

    # ---------------------------------------------------------------- the schedule's shape

    def due(self, worker: int, op: int) -> int:
        return op * self.scale + worker * self.delta

    def owner(self, stage: int, part: int = 0) -> int:
        return self.owners[self._first[stage] + part]

    def place(self, stage: int, worker: int, part: int = 0) -> int:
        """``worker``'s place in the chain of stage ``stage``'s piece ``part`` (0 first, N-1 the owner)."""
        return (worker - self.owner(stage, part) - 1) % self.workers

    def at_place(self, stage: int, place: int, part: int = 0) -> int:
        return (self.owner(stage, part) + 1 + place) % self.workers

    def ring_next(self, stage: int, worker: int, part: int = 0) -> int | None:
        """Who ``worker`` passes the final buffer of stage ``stage``'s piece ``part`` to: the ring
        runs from the owner through chain places 0, 1, ..., N-2."""
        place = self.place(stage, worker, part)
        if place == self.workers - 2:
            return None
        return self.at_place(stage, 0 if place == self.workers - 1 else place + 1, part)

    def gate(self, worker: int, op: int) -> int:
        """The predecessor's last op that must be done before ``worker``'s op ``op`` (-1: none)."""
        if self.workers == 1:
            return -1
        need = op - 1 + self.lead - (self.period if worker == 0 else 0)
        return max(need, -1)

    def fresh(self, worker: int, stage: int) -> bool:
        """v2: worker n computes stage l with the newest parameters iff l >= (N-1-n) L / N."""
        return stage * self.workers >= (self.workers - 1 - worker) * self.stages

    def backward_op(self, step: int, stage: int) -> int:
        return self.period * step + self.period - 1 - stage

    def lag(self, worker: int, stage: int) -> int:
        """Steps between a step's gradient and the first step that computes with it: 1 under
        ``sync`` and where a v2 worker is fresh on the stage, else 2."""
        return 1 if self.rule == "sync" or (self.rule == "v2" and self.fresh(worker, stage)) else 2

    def version(self, worker: int, step: int, stage: int) -> int:
        """Fetch: the parameters ``worker`` computes stage ``stage`` of step ``step`` with: those
        after the update of this step's gradient (-1: the initial ones)."""
        return max(step - self.lag(worker, stage), -1)

    def use_op(self, step: int, stage: int, kind: str) -> int:
        """The op a fetch ("fetch": the forward's, "refetch": the backward's) is taken before."""
        return self.period * step + (stage if kind == "fetch" else self.period - 1 - stage)

    def readers(self, stage: int) -> list[int]:
        """The stages whose ops read ``stage``'s parameters (:func:`readers_of`)."""
        return readers_of(stage, self.reads)

    def op_reads(self, op: int) -> list[int]:
        """The stages whose parameters op ``op`` reads: its own and those it reads (``reads``)."""
        stage, _ = op_stage(op, self.stages)
        return [r for r in sorted({stage, *self.reads[stage]}) if self.has_params[r]]

    def last_read(self, step: int, stage: int) -> int:
        """The last op of step ``step`` that reads ``stage``'s parameters."""
        return max(self.use_op(step, j, kind) for j in self.readers(stage) for kind in ("fetch", "refetch"))

    def _versions(self, owner: int, version: int, stage: int, part: int) -> None:
        """Fetch: the messages carrying ``version`` of a piece from its owner: one before each
        forward and backward of each step that computes with it on each other worker, each sent
        once the owner has begun the step before (so a rank's last step sends none for a step
        two ahead, which would never run); the version is kept until they are taken and its
        owner's own ops have run."""
        out, own, uses = [], 0, self.readers(stage)
        for n in range(self.workers):
            steps = range(self.lag(n, stage)) if version < 0 else (version + self.lag(n, stage),)
            if n == owner:
                own = 2 * len(steps) * len(uses)
                continue
            out += [Message(s, stage, kind, self.place(stage, n, part), owner, n, part, at) for s in steps for at in uses
                    for kind in ("fetch", "refetch")]
        self._queued[owner] += out
        self._refs[("sum", version, stage, part)] += len(out) + own

    def uses_at(self, worker: int, op: int) -> list[tuple[int, int]]:
        """The (step, stage) updates ``worker`` applies just before op ``op`` (module docstring):
        at a step's start, when the previous step's activations are gone (the optimizer's
        temporaries then meet no activation, as in data parallelism). Star (v2 always; no
        optimizer step but the owner's, done when its sum is complete, or with ZeRO-0 the
        worker's own with the sum it received): just before the step's forward of the stage, the
        last moment."""
        step, j = divmod(op, self.period)
        if self.fetch:
            return []  # nothing installed: each op's parameters arrive before it (Clock._has_params_for)
        if self.star:
            t = step - self.lag(worker, j) if j < self.stages else -1
            return [(t, j)] if t >= 0 and self.has_params[j] else []
        if j != 0:
            return []
        t = step - self.lag(worker, 0)  # sync: the step before's; v1: the one before that
        return [(t, stage) for stage in range(self.stages) if t >= 0 and self.has_params[stage]]

    # ---------------------------------------------------------------- answers

    def actions(self, worker: int, op: int) -> OpActions:
        """What ``worker`` does before its op ``op`` (simulating as far as needed; ops are asked for
        in order on each rank, and forgotten once asked for)."""
        while (worker, op) not in self._done:
            self._advance()
        return self._done.pop((worker, op))

    def drained_by(self, last_step: int) -> int:
        """The op index by which every worker has received and waited for every message of steps
        <= ``last_step`` (all 2(N-1) per stage), and passed every update theta(last_step + 1) needs:
        after its last step a rank runs the ops before it without compute (runtime.cdp)."""
        while any(self._closed.get(t, 0) < self.messages_per_step for t in range(last_step + 1)):
            self._advance()
        # the last update theta(last_step + 1) takes: at step last_step + 2's start, or (star) before its forward of the last stage
        last_use = self.period * (last_step + 2) + (self.stages - 1 if self.star else 0)
        return max(last_use + 1, max((self._touched.get(t, 0) for t in range(last_step + 1)), default=0) + 1)

    # ---------------------------------------------------------------- the simulation

    def _advance(self) -> None:
        """Process the worker whose clock is earliest: its next boundary's services, then its op."""
        if not self._queue:
            raise RuntimeError(f"CDP's clock is stuck: workers {sorted(self._parked)} wait for each other at ops "
                               f"{[self._boundary[n].op for n in sorted(self._parked)]} (a bug in the schedule)")
        tick, phase, n, _ = heapq.heappop(self._queue)
        b = self._boundary[n]
        b.now = max(b.now, tick)
        changed = self._serve(n, b)
        if b.blocked is None and phase == 0:  # ops start once everything due at this tick is served
            self._push(n, b.now, phase=1)
        elif b.blocked is None:
            self._run(n, b)
            changed = True
        elif b.blocked > b.now:
            self._push(n, b.blocked)
        else:
            self._parked.add(n)
        if changed:  # what it did may let a parked worker on, from now
            for m in sorted(self._parked):
                self._parked.discard(m)
                self._boundary[m].now = max(self._boundary[m].now, b.now)
                self._push(m, self._boundary[m].now)

    def _push(self, worker: int, tick: int, phase: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (tick, phase, worker, self._seq))

    def _end(self, worker: int, op: int) -> int | None:
        start = self._start.get((worker, op))
        return None if start is None else start + self.scale

    def _send(self, message: Message, avail: int) -> None:
        self._msgs[message] = _Msg(message, avail)
        self._incoming[message.dst].append(message)
        self._outgoing[message.src].append(message)

    def _serve(self, n: int, b: _Boundary) -> bool:
        """Do what worker ``n`` can do at ``b.now`` before its op ``b.op``: wait for the sends whose
        receive is posted, receive (and pass on) what has arrived, take the tokens once its
        predecessor's op has ended. Sets ``b.blocked``: None when the op can start now, else the
        tick to look again at (b.now: when something else changes)."""
        acts, now, op, big_n = b.acts, b.now, b.op, self.workers
        did, progress = False, True
        while progress:
            progress = False
            for message in [m for m in self._queued[n] if op >= self.period * (m.step - 1)]:  # fetch: versions due out
                self._queued[n].remove(message)
                self._send(message, now)
                self._log(acts, ("send", message, now))
                progress = did = True
            for message in list(self._outgoing[n]):  # sends whose receive is posted
                m = self._msgs[message]
                if 0 <= m.recv_end <= now:
                    self._log(acts, ("wait", message, now))
                    self._outgoing[n].remove(message)
                    del self._msgs[message]
                    if message.kind != "token":
                        self._closed[message.step] = self._closed.get(message.step, 0) + 1
                        self._touched[message.step] = max(self._touched.get(message.step, 0), op)
                    if message.kind == "chain":
                        self._chain_done.add((n, message.step, message.stage, message.part))
                    if message.kind == "deliver":
                        self._release(("sum", message.step, message.stage, message.part))
                    if message.kind in ("fetch", "refetch"):
                        self._release(("sum", self.version(message.dst, message.step, message.stage), message.stage, message.part))
                    if message.kind == "reduce":
                        self._release(("grads", n, message.step, message.stage))
                    progress = did = True
            for message in sorted(m for m in self._incoming[n] if m.kind != "token"):  # what has been sent here
                m = self._msgs[message]
                if m.avail > now:
                    continue
                if m.posted < 0:
                    if message.kind == "chain" and self.backward_op(message.step, message.stage) >= op:
                        continue  # the partial sum is added to this worker's own gradient, made at its backward
                    if message.kind == "ring" and (n, message.step, message.stage, message.part) not in self._chain_done:
                        continue  # it arrives in the buffer the chain sent from, once that send has completed
                    if message.kind == "reduce" and op <= self.period * message.step:
                        continue  # star: taken once the owner has begun that step (a rank's last step may be its last)
                    if message.kind == "deliver" and op <= self.backward_op(message.step + self.lag(n, message.stage) - 1, message.stage):
                        continue  # star: received into the parameters, once the receiver's last use of the old ones has ended
                    if message.kind in ("fetch", "refetch") and op < self._fetch_post(message):
                        continue  # fetch: posted an op ahead of its use, once the stage's last use has ended
                    m.posted = now  # its receive is posted: it travels while this worker computes
                    if message.kind == "deliver" and self.replicated:  # kept by its receiver until its update
                        self._refs[("got", n, message.step, self._first[message.stage] + message.part)] = 1
                    self._log(acts, ("post", message, now))
                    progress = did = True
                due = message.kind == "deliver" and (message.step, message.stage) in self.uses_at(n, op)
                if message.kind in ("fetch", "refetch"):
                    if op >= self.use_op(message.step, message.at, message.kind):  # taken just before its op
                        self._receive(n, b, message)
                        progress = did = True
                    continue
                if m.posted + self._hold(message) <= now or due:  # taken (and passed on)
                    self._receive(n, b, message)
                    progress = did = True
        gate_end: int | None = now
        if not b.gated:
            gate = self.gate(n, op)
            if gate > self._tokens_taken[n]:
                gate_end = self._end((n - 1) % big_n, gate)
                if gate_end is not None and gate_end <= now:
                    pred = (n - 1) % big_n
                    for psi in range(self._tokens_taken[n] + 1, gate + 1):
                        m = self._msgs[Message(psi, -1, "token", 0, pred, n)]
                        m.recv_end = now
                        self._incoming[n].remove(m.message)
                    self._tokens_taken[n] = gate
                    self._log(acts, ("tokens", gate, now))
                    did = True
                    b.gated = True
            else:
                b.gated = True
        pending = [self._msgs[k] for k in self._incoming[n] if k.kind != "token"]
        later = [t for m in pending for t in (m.avail, m.posted + self._hold(m.message) if m.posted >= 0 else -1) if t > now]
        if not b.gated:
            b.blocked = min([*later, gate_end]) if gate_end is not None else (min(later) if later else now)
        elif any((n, t, stage, part) not in self._final for t, stage in self.uses_at(n, op) for part in range(self.parts[stage])):
            b.blocked = min(later) if later else now
        elif self.fetch and not self._has_params_for(n, op):
            b.blocked = min(later) if later else now
        else:
            b.blocked = None
        return did

    def _fetch_post(self, message: Message) -> int:
        """Fetch: the op boundary its receiver posts ``message``'s receive at: the one before its
        op (it arrives while that op computes), unless that op reads the same stage's parameters
        (they arrive in the same buffer), then its own."""
        use = self.use_op(message.step, message.at, message.kind)
        return use if use == 0 or message.stage in self.op_reads(use - 1) else use - 1

    def _has_params_for(self, n: int, op: int) -> bool:
        """Fetch: whether worker ``n`` has every piece of the parameters its op ``op`` reads: its
        own pieces' version made (its sum final), the others' fetched."""
        if self.workers == 1:
            return True
        step = op // self.period
        at, kind = op_stage(op, self.stages)
        for stage in self.op_reads(op):
            version = self.version(n, step, stage)
            for part in range(self.parts[stage]):
                if self.owner(stage, part) == n:
                    if version >= 0 and (n, version, stage, part) not in self._final:
                        return False
                elif (n, step, stage, part, kind, at) not in self._fetched:
                    return False
        return True

    def _hold(self, message: Message) -> int:
        """Ticks between posting the receive of ``message`` and taking it: with ``hold`` (v1's ring
        copies, applied at a step's start, a step after they are due at the earliest), a ring copy
        travels for an op of the receiver's compute; a chain's partial sum is taken at once (it
        arrives ops after it left, while the receiver ran its own ops), and so are sync's ring
        copies. Star: an owner's delivery travels for an op, or until it is due
        (:meth:`uses_at`), whichever comes first."""
        if message.kind == "deliver":
            return self.scale
        return self.hold if message.kind == "ring" else 0

    def _log(self, acts: OpActions, entry: tuple[str, Message | int, int]) -> None:
        self._order += 1
        acts.log.append(entry)
        acts.log_order.append(self._order)

    def _receive(self, n: int, b: _Boundary, message: Message) -> None:
        m = self._msgs[message]
        m.recv_end = b.now
        self._incoming[n].remove(message)
        self._log(b.acts, ("recv", message, b.now))
        step, stage, part, big_n = message.step, message.stage, message.part, self.workers
        self._touched[step] = max(self._touched.get(step, 0), b.op)
        if message.kind == "reduce":
            self._contribute(n, b.op, b.now, b.acts, step, stage, part, via=message)
            return
        if message.kind == "deliver":
            self._final[(n, step, stage, part)] = b.op
            return
        if message.kind in ("fetch", "refetch"):
            self._fetched.add((n, step, stage, part, message.kind, message.at))
            return
        onward: Message | None = None
        if message.kind == "chain" and message.place + 1 < big_n - 1:
            onward = Message(step, stage, "chain", message.place + 1, n, (n + 1) % big_n, part)
        else:  # the owner's sum, or the ring's copy: final here, and passed on
            self._final[(n, step, stage, part)] = b.op
            after = self.ring_next(stage, n, part)
            if after is not None:
                onward = Message(step, stage, "ring", 0 if message.kind == "chain" else message.place + 1, n, after, part)
        if onward is not None:
            self._send(onward, b.now)
            b.acts.forwards[message] = onward

    def _contribute(self, owner: int, op: int, tick: int, acts: OpActions, step: int, stage: int, part: int, via: Message | None) -> None:
        """Star: one more worker's gradient of the piece summed at its owner (``via`` the reduce
        that brought it; None: the owner's own, at the end of its backward op ``op``). With all N
        the sum is final: the owner updates and sends each worker its new parameters."""
        key = (step, stage, part)
        if key not in self._summed:  # born: freed once the owner has installed it and each delivery has been taken (fetch: used)
            self._refs[("sum", step, stage, part)] = 0 if self.fetch else self.workers
        self._summed[key] = self._summed.get(key, 0) + 1
        if self._summed[key] < self.workers:
            return
        del self._summed[key]
        self._final[(owner, step, stage, part)] = op
        if self.fetch:  # the new parameters are a version: sent to the workers that compute with it
            self._versions(owner, step, stage, part)
            out: list[Message] = []
        else:
            out = [Message(step, stage, "deliver", k, owner, (owner + 1 + k) % self.workers, part) for k in range(self.workers - 1)]
            for message in out:
                self._send(message, tick)
        if via is None:
            acts.heads.extend(out)
        else:
            acts.delivers[via] = out

    def _release(self, key: Held) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]

    def _run(self, n: int, b: _Boundary) -> None:
        """Worker ``n``'s op ``b.op`` starts at ``b.now``: its updates, the op, then (after a
        backward) the chain it heads and, after every op, its token."""
        op, tick, big_n, acts = b.op, b.now, self.workers, b.acts
        self._start[(n, op)] = tick
        acts.start = tick
        self._order += 1
        acts.order = self._order
        end = tick + self.scale
        acts.uses = self.uses_at(n, op)
        step, j = divmod(op, self.period)
        if self.star and big_n > 1:
            for t, stage in acts.uses:
                for part in range(self.parts[stage]):
                    if self.owner(stage, part) == n:
                        self._release(("sum", t, stage, part))
                    elif self.replicated:
                        self._release(("got", n, t, self._first[stage] + part))
            for used in self.op_reads(op) if self.fetch else []:  # its own pieces' versions, used by this op
                for part in range(self.parts[used]):
                    if self.owner(used, part) == n:
                        self._release(("sum", self.version(n, step, used), used, part))
            if j == 0 and self.keep is None:  # what a rank holds between steps (runtime.cdp.CDPTrainer.message_bytes)
                self.live[(n, op)] = tuple(sorted(k for k in self._refs if (k[0] in ("grads", "got") and k[1] == n)
                                                  or (k[0] == "sum" and self.owner(k[2], k[3]) == n)))
        if j >= self.stages and self.has_params[self.period - 1 - j]:
            stage = self.period - 1 - j
            for part in range(self.parts[stage]):
                if big_n == 1:
                    self._final[(n, step, stage, part)] = op
                elif self.star and self.owner(stage, part) == n:
                    self._contribute(n, op, end, acts, step, stage, part, via=None)
                elif self.star:
                    head = Message(step, stage, "reduce", self.place(stage, n, part), n, self.owner(stage, part), part)
                    acts.heads.append(head)
                    self._send(head, end)
                    self._refs[("grads", n, step, stage)] = self._refs.get(("grads", n, step, stage), 0) + 1
                elif self.place(stage, n, part) == 0:
                    head = Message(step, stage, "chain", 0, n, (n + 1) % big_n, part)
                    acts.heads.append(head)
                    self._send(head, end)
        if big_n > 1:
            self._send(Message(op, -1, "token", 0, n, (n + 1) % big_n), end)
        if self.keep is None or self.keep == n:
            self._done[(n, op)] = acts
        if op % self.period == 0:  # forget what no later op looks at
            for old in [k for k in self._start if k[0] == n and k[1] < op - 4 * self.period]:
                del self._start[old]
            for done in [k for k in self._final if k[0] == n and k[1] < step - 3]:
                del self._final[done]
        self._boundary[n] = _Boundary(op + 1, max(self.due(n, op + 1), end), OpActions(n, op + 1, -1))
        self._push(n, self._boundary[n].now)


@dataclass
class _Boundary:
    """A worker between two ops: the op it is about to run, its clock, and what it has done."""

    op: int
    now: int
    acts: OpActions
    gated: bool = False
    blocked: int | None = None


def schedule_units(sizes: Sequence[int], workers: int, rule: str, zero: bool, itemsize: Sequence[int] | None = None, star: bool = False,
                   fetch: bool = False, reads: tuple[tuple[int, ...], ...] | None = None) -> Units:
    """Each stage's pieces and each piece's owner (where its chain ends; ``star``: where its
    gradients are sent) for CDPTrainer: :func:`planner.stages.message_units` (the ranks' sent
    bytes, and with ZeRO their optimizer state, evened). Under the star a rank sends what it owns
    N-1 times and the rest once, so its owners even the bytes each rank owns, as ZeRO's do,
    whatever the ZeRO stage. Under ``v2`` a fresh stage's sum must be final before the next
    step's forward: should those owners stretch the schedule (none of the clock tests' and
    planner's configurations does: the star's sum is final two messages after the last backward),
    one piece a stage with the owners :func:`planner.stages.stage_owners` picks is tried, then
    worker N-1 owning every stage, as in the paper, whose sums are final soonest."""
    uses = None
    if fetch:  # each piece fetched before each forward and backward that reads it
        uses = [2 * len(readers_of(stage, reads)) for stage in range(len(sizes))]
    units = message_units(sizes, workers, zero=zero, itemsize=itemsize, uses=uses, star=star)
    if rule != "v2" or workers == 1:
        return units
    has = tuple(b > 0 for b in sizes)
    whole = Units((1,) * len(sizes), stage_owners(sizes, workers, zero=zero or star), tuple(sizes))
    for candidate in (units, whole):
        if _stretch(workers, len(sizes), candidate.owners, rule, has, parts=candidate.parts, star=star, fetch=fetch, reads=reads) == 0:
            return candidate
    return Units((1,) * len(sizes), (workers - 1,) * len(sizes), tuple(sizes))


def ring_hold(workers: int, stages: int, owners: Sequence[int], rule: str, has_params: Sequence[bool], parts: Sequence[int] | None = None,
              star: bool = False) -> bool:
    """Whether the ring copies applied at a step's start (v1's) may travel for an op before their
    receivers take them: where the clock's schedule still holds with it (a ring of N-1 hops an op
    each, and the wraps, within the rule's slack; not at N = 8, L = 4). Never with ``star`` (no
    ring; v2 always)."""
    if star or rule != "v1":
        return False
    pieces = tuple(parts) if parts is not None else (1,) * stages
    return workers > 1 and _stretch(workers, stages, tuple(owners), rule, tuple(has_params), hold=True, parts=pieces) == 0


@functools.lru_cache(maxsize=256)
def _stretch(workers: int, stages: int, owners: tuple[int, ...], rule: str, has_params: tuple[bool, ...], steps: int = 12, hold: bool = False,
             parts: tuple[int, ...] | None = None, star: bool = False, fetch: bool = False,
             reads: tuple[tuple[int, ...], ...] | None = None) -> int:
    """Ticks the clock's steps run over their due length in steady state, over its last three
    simulated steps (0: the schedule holds; the first steps may settle into a constant lag).
    Cached: the planner asks it for every evaluation of a CDP configuration (up to 0.04 s a run
    at N = L = 8), with the same few schedules."""
    clock = Clock(workers, stages, owners, rule, has_params, hold=hold, parts=parts, star=star, fetch=fetch, reads=reads)
    lag = {(n, op): clock.actions(n, op).start - clock.due(n, op) for op in range(2 * stages * steps) for n in range(workers)}
    last, before = 2 * stages * (steps - 1), 2 * stages * (steps - 4)
    return max(lag[(n, last)] - lag[(n, before)] for n in range(workers))
