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
