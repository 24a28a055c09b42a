"""Cutting a traced graph into L contiguous stages balanced by compute (for CDP, design.md section 6).

The ops, in graph (topological) order, with costs c_i = forward + backward FLOPs (at least 1, so
FLOP-free ops still count), are split into L contiguous runs minimising the largest run's cost
(the "linear partition" problem): binary search on the bound B, each bound checked greedily (a run
is closed when adding the next op would exceed B), O(n log sum c). The optimal bound found, the
same greedy pass gives the cut; runs are then rebalanced so none is empty.

A stage's activation memory A_l is the bytes its ops save for backward (from the trace), which
CDP's memory formula weighs: sum over workers at any time (N/L) sum_l (L - l) A_l, 0-indexed.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.ir import IRGraph


@dataclass(frozen=True)
class StageCut:
    stages: tuple[tuple[str, ...], ...]  # op node names of each stage, in graph order
    flops: tuple[int, ...]
    saved_bytes: tuple[int, ...]  # A_l, the whole batch

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of(self) -> dict[str, int]:
        return {name: stage for stage, names in enumerate(self.stages) for name in names}

    def imbalance(self) -> float:
        """Largest stage's FLOPs over the mean (1.0 is perfect balance)."""
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0


def _runs(costs: list[int], bound: int) -> list[int]:
    """Greedy run lengths with no run above ``bound``."""
    runs, current, length = [], 0, 0
    for c in costs:
        if length and current + c > bound:
            runs.append(length)
            current, length = 0, 0
        current += c
        length += 1
    runs.append(length)
    return runs


def cut_stages(graph: IRGraph, num_stages: int) -> StageCut:
    ops = [n for n in graph.nodes.values() if n.kind == "op"]
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > len(ops):
        raise ValueError(f"cannot cut {len(ops)} ops into {num_stages} stages; use at most {len(ops)}")
    costs = [max(n.flops_fwd + n.flops_bwd, 1) for n in ops]
    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_runs(costs, mid)) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    runs = _runs(costs, lo)
    while len(runs) < num_stages:  # split the longest run: still within the bound
        k = max(range(len(runs)), key=lambda i: runs[i])
        runs[k : k + 1] = [runs[k] // 2, runs[k] - runs[k] // 2]
    stages, flops, saved = [], [], []
    start = 0
    for length in runs:
        chunk = ops[start : start + length]
        start += length
        stages.append(tuple(n.name for n in chunk))
        flops.append(sum(n.flops_fwd + n.flops_bwd for n in chunk))
        saved.append(sum(s.nbytes for n in chunk for s in n.saved))
    return StageCut(tuple(stages), tuple(flops), tuple(saved))


def stage_owners(stage_bytes: Sequence[int], workers: int, *, zero: bool) -> tuple[int, ...]:
    """Each unit's owner for CDP over ``workers`` workers (runtime.cdp.CDPTrainer): where the
    unit's gradient chain ends and its ring starts (and, with ZeRO, where its optimizer state and
    master copy live). ``stage_bytes``: each unit's message on a rank (a stage's gradient buffer, or
    a piece of it: :func:`message_units`); below, "stage" is a unit.

    A rank sends a stage's buffer twice a step (down the chain, around the ring), but once where it
    is the owner (the chain ends there) or the worker before it (the ring ends there). So:

    * without ZeRO the owners even the ranks' sent bytes: stages in decreasing size, each to the
      owner o whose pair (o, o-1) sends most now (the larger of the two, then the smaller; ties
      to the lowest o). Measured, 4 workers: max/min sent bytes 1.04-1.10 on gpt-tiny, mlp-large
      and gpt2-small with L >= N stages, against 2.0 with one owner for every stage; with fewer
      stages than workers some ranks own no stage and it stays higher (gpt2-small, L=4, N=8: 1.39),
      which cutting stages into pieces mends (:func:`message_units`, whose units this assigns);
    * with ZeRO the owners even the optimizer state they hold, which sets the peak memory: stages
      in decreasing size, each to the worker that owns the fewest bytes (ties to the lowest).

    Deterministic: every worker computes the same owners from the same sizes."""
    order = sorted(range(len(stage_bytes)), key=lambda s: (-stage_bytes[s], s))
    owners = [0] * len(stage_bytes)
    if zero:
        held = [(0, w) for w in range(workers)]  # a heap: the worker that owns the fewest bytes (ties to the lowest) on top
        for s in order:
            least, w = heapq.heappop(held)
            owners[s] = w
            heapq.heappush(held, (least + stage_bytes[s], w))
        return tuple(owners)
    sent = [2 * sum(stage_bytes)] * workers
    for s in order:
        def pair(o: int) -> tuple[int, int, int]:
            a, b = sent[o], sent[(o - 1) % workers]
            return max(a, b), min(a, b), -o
        owners[s] = o = max(range(workers), key=pair)
        if workers > 1:
            sent[o] -= stage_bytes[s]
            sent[(o - 1) % workers] -= stage_bytes[s]
    return tuple(owners)


BALANCE = 1.10  # CDP: the most a rank's sent bytes (and, with ZeRO, its owned bytes) may exceed the least's


@dataclass(frozen=True)
class Units:
    """CDP's messages (runtime.cdp.CDPTrainer): each stage's flat gradient buffer cut into
    ``parts[l]`` pieces of about equal length, each a unit with its own chain, ring and owner
    (units in stage order, then piece order). ``sizes``: each unit's bytes on a rank."""

    parts: tuple[int, ...]
    owners: tuple[int, ...]
    sizes: tuple[int, ...]

    def unit(self, stage: int, part: int = 0) -> int:
        return sum(self.parts[:stage]) + part

    def of_stage(self, stage: int) -> range:
        first = sum(self.parts[:stage])
        return range(first, first + self.parts[stage])


def piece_bounds(elements: int, parts: int) -> list[tuple[int, int]]:
    """The element ranges a buffer of ``elements`` values is cut into, ``parts`` of them (as equal
    as whole elements allow; the planner and the runtime cut alike)."""
    return [(c * elements // parts, (c + 1) * elements // parts) for c in range(parts)]


def sent_bytes(sizes: Sequence[int], owners: Sequence[int], workers: int, *, star: bool = False, uses: Sequence[int] | None = None) -> list[int]:
    """Each rank's sent bytes a step: a unit's buffer twice (down the chain, around the ring), once
    where the rank owns it (the chain ends there) or is the worker before its owner (the ring ends
    there). ``star`` (the clock's star: ZeRO-2 and 3, and v2): a unit once, to its owner, and N-1 times where the rank
    owns it (its new parameters to each other worker), or, ``uses`` (ZeRO-3), that many times N-1
    (a fetch before each forward and backward that reads it)."""
    if workers == 1:
        return [0]
    if star:
        out = [sum(sizes)] * workers
        for u, (b, o) in enumerate(zip(sizes, owners, strict=True)):
            out[o] += ((workers - 1) * (uses[u] if uses is not None else 1) - 1) * b
        return out
    saved = [0] * workers
    for b, o in zip(sizes, owners, strict=True):
        saved[o] += b
        saved[(o - 1) % workers] += b
    return [2 * sum(sizes) - x for x in saved]


def owned_bytes(sizes: Sequence[int], owners: Sequence[int], workers: int) -> list[int]:
    out = [0] * workers
    for b, o in zip(sizes, owners, strict=True):
        out[o] += b
    return out


def _spread(values: Sequence[int]) -> float:
    return max(values) / min(values) if min(values) > 0 else math.inf


def message_units(stage_bytes: Sequence[int], workers: int, *, zero: bool, itemsize: Sequence[int] | None = None,
                  uses: Sequence[int] | None = None, star: bool = False) -> Units:
    """Each stage's piece count and each piece's owner (:func:`stage_owners`): of the cuts that
    keep every rank's sent bytes, and with ZeRO its owned bytes (its optimizer state and master
    copy), within :data:`BALANCE` of the least, the one with the fewest pieces (each costs 2(N-1)
    messages a step); where none does, the one that comes closest. The cuts tried: the same count
    c for every stage with parameters (1 to 8, the multiples of N / gcd(N, L) up to N, which give
    every worker as many pieces, and counts about 1.5x apart), and counts in proportion to the
    stages' bytes (a stage of b bytes in ceil(b / t) pieces, t = S / (k N), S the stages' bytes,
    k = 1 to 16), which cut a large stage (an embedding's) and leave the small ones whole.
    ``itemsize``: each stage's bytes per value (pieces are whole values; default 1).

    With L >= N stages, one piece a stage is usually enough (the owners differ from stage to
    stage). With fewer stages than workers some ranks would own nothing: they send every buffer
    twice while the owners send theirs once, and with ZeRO only L ranks hold optimizer state
    (gpt2-small, L = 4, N = 8: 1.39 in sent bytes). Cutting stages into pieces gives every rank
    pieces to own.

    ``uses`` (CDP with ZeRO-3, the star): each stage's sends per piece to each other worker from
    its owner (a fetch before each forward and backward that reads it); the sent bytes checked are
    then the star's (:func:`sent_bytes`), so a piece read by more ops (a tied embedding) is cut
    until every rank owns as much of it. ``star`` (the clock's star, ``uses`` or not): the sent
    bytes checked are the star's, a rank sending what it owns N-1 times and the rest once, so the
    owners are picked to even the bytes each owns (as ZeRO's): without ZeRO that is the only
    check, which a cut with fewer pieces passes than the owned bytes' own (each piece costs
    messages, the latency a small model's step is made of)."""
    return _message_units(tuple(stage_bytes), workers, zero, tuple(itemsize) if itemsize is not None else (1,) * len(stage_bytes),
                          tuple(uses) if uses is not None else None, star)


@functools.lru_cache(maxsize=256)
def _message_units(stage_bytes: tuple[int, ...], workers: int, zero: bool, align: tuple[int, ...], uses: tuple[int, ...] | None = None,
                   star: bool = False) -> Units:
    """:func:`message_units`, cached: a search evaluates a CDP configuration's plans many times,
    mostly with the same stage sizes. The cuts are tried fewest pieces first, so the first that
    balances is the answer; with ZeRO a cut with fewer pieces than workers is not tried (a worker
    would own no state). At N = 4096 and 8 stages with ZeRO it takes 0.6 s (trying every count
    up to N, 57 s)."""
    total = sum(stage_bytes)
    with_params = sum(1 for b in stage_bytes if b) or 1
    step = max(workers, 1) // math.gcd(max(workers, 1), with_params)  # the counts that give every worker as many pieces
    counts = {*range(1, min(workers, 8) + 1), workers, *range(step, workers + 1, step),
              *(round(1.5 ** i) for i in range(6, 64) if 1.5 ** i < workers)}
    cuts = [tuple(c if b else 1 for b in stage_bytes) for c in sorted(counts) if c <= max(workers, 1)]
    cuts += [tuple(max(1, -(-b * k * workers // total)) if b else 1 for b in stage_bytes) for k in range(1, 17)] if total else []
    # (a stage is cut into whole values, so into no more pieces than it has values)
    cuts = [tuple(min(c, max(1, b // a)) for c, b, a in zip(cut, stage_bytes, align, strict=True)) for cut in cuts]
    def pieces(parts: tuple[int, ...]) -> int:
        return sum(p for p, b in zip(parts, stage_bytes, strict=True) if b)

    most = max(pieces(cut) for cut in cuts)
    best: tuple[float, Units] | None = None
    for parts in sorted(dict.fromkeys(cuts), key=sum):
        if zero and pieces(parts) < workers <= most:
            continue  # some worker would own no state (unless no cut has a piece for every worker)
        sizes = tuple((hi - lo) * a for b, c, a in zip(stage_bytes, parts, align, strict=True) for lo, hi in piece_bounds(b // a, c))
        owners = stage_owners(sizes, workers, zero=zero or star)
        unit_uses = [k for c, k in zip(parts, uses, strict=True) for _ in range(c)] if uses is not None else None
        sent = sent_bytes(sizes, owners, workers, star=star or uses is not None, uses=unit_uses)
        spread = _spread(sent) if workers > 1 else 1.0
        if zero and workers > 1:
            spread = max(spread, _spread(owned_bytes(sizes, owners, workers)))
        units = Units(parts, owners, sizes)
        if spread <= BALANCE:
            return units
        if best is None or spread < best[0] - 1e-12:
            best = (spread, units)
    assert best is not None
    return best[1]


def parameter_stages(graph: IRGraph, num_stages: int) -> dict[str, int]:
    """Each parameter's stage: the earliest stage that reads it (its gradient is complete when that
    stage's backward ends), as runtime/stages.py assigns them (StagedRunner.param_stage)."""
    stage_of = cut_stages(graph, num_stages).stage_of()
    consumers = graph.consumers()
    return {
        p.name: min((stage_of[c] for c, _ in consumers[p.name] if c in stage_of), default=0)
        for p in graph.params
    }


def in_flight(workers: int, stages: int, stage: int) -> int:
    """CDP with stages on different devices (runtime.cdp_pipeline.CDPPipeline): the most
    micro-batches whose stage-``stage`` activations one device holds at once.

    Stage l runs on D = ceil(N/L) devices, device j serving the workers n = j (mod D); worker n
    holds its stage-l activations from its forward's start, 2Lk + n*delta + l, to its backward's
    end, 2Lk + n*delta + 2L - l (delta = 2L/N time units). Counted on a clock of 1/s units, s =
    N / gcd(2L, N), where every start and end is a whole tick. With L dividing N a device's L
    workers arrive 2 units apart and it holds L - l, returned as such (the count takes
    O(N^2 / L) steps: 57 s for the three estimates of 4096 devices, a "nothing fits" message's;
    tests/test_cdp.py checks the two agree); otherwise the arrivals are uneven and the count is
    the largest over the devices and the step."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} of {stages}")
    return stages - stage if workers % stages == 0 else counted_in_flight(workers, stages, stage)


def counted_in_flight(workers: int, stages: int, stage: int) -> int:
    """:func:`in_flight` counted on the clock, tick by tick, for any N and L."""
    devices = -(-workers // stages)
    scale = workers // math.gcd(2 * stages, workers)
    period, delta, held = 2 * stages * scale, 2 * stages * scale // workers, 2 * (stages - stage) * scale
    most = 0
    for column in range(devices):
        starts = [(n * delta + stage * scale) % period for n in range(column, workers, devices)]
        most = max(most, max(sum(1 for a in starts if (tick - a) % period < held) for tick in range(period)))
    return most
