"""CDP with each ZeRO stage on 4 gloo ranks: step time and the bytes a rank holds between steps.

    python benchmarks/cdp_zero.py [MODEL] [BATCH] [STAGES]     # default: mlp-large 16 4

For ZeRO 0-3, the planner's CDP v1 plan over dp = 4 (``search`` with ``zero=(stage,)``), trained by
``runtime.cdp.CDPTrainer`` (AdamW) on 4 gloo ranks of this host: ZeRO 0/1 sum each stage's gradient
along the chain and pass it (ZeRO-1: the owner's new parameters) around the ring; ZeRO-2 and 3 send it
straight to each piece's owner, ZeRO-2 sends the new parameters straight back, ZeRO-3 keeps them on the
owner and fetches them before each op (planner.cdp_clock's star). Rounds interleave the four plans;
each is a fresh trainer, 2 warm-up steps, then the median of 6 steps on the slowest rank (CDP steps
run back to back: no barrier may start them together). Held: the most any rank holds between steps
of parameters, optimizer state and CDP's message buffers (``held_bytes`` and ``message_bytes``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = sys.argv[1] if len(sys.argv) > 1 else "mlp-large"
BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 16
STAGES = int(sys.argv[3]) if len(sys.argv) > 3 else 4
WORLD, ROUNDS, STEPS = 4, 2, 6


def plans() -> list[tuple[int, str]]:
    from planner.config import SearchConfig
    from planner.models import build_model, example_inputs
    from planner.search import search
    from planner.trace import trace
    graph = trace(build_model(MODEL, seed=0), *example_inputs(MODEL, batch=BATCH, seed=1))
    out = []
    for zero in (0, 1, 2, 3):
        config = SearchConfig(devices=WORLD, tp=("none",), dp=WORLD, zero=(zero,), cdp=("v1",), cdp_stages=STAGES, front=False)
        best = search(graph, config, model_name=MODEL).best
        assert best is not None, zero
        out.append((zero, best.model_dump_json()))
    return out


def measure(rank: int, world: int, cases: list[tuple[int, str]]) -> list[tuple[Any, ...]]:
    import torch.distributed as dist

    from planner.models import build_model, example_inputs
    from planner.plan import Plan
    from planner.runtime.cdp import CDPTrainer
    from planner.runtime.compile import compile_plan
    torch.set_num_threads(1)
    rows = []
    for rnd in range(ROUNDS):
        for zero, text in cases:
            plan = Plan.model_validate_json(text)
            args, kwargs = example_inputs(MODEL, batch=BATCH, seed=1)
            pm = compile_plan(plan, build_model(MODEL, seed=0), args, kwargs, loss_partial_over=frozenset(plan.mesh_obj.active_dp_axes))
            a, k = pm.shard_batch(*args, **kwargs)
            tr = CDPTrainer(pm, torch.optim.AdamW, lr=1e-3)
            for _ in range(2):
                tr.step(*a, **k)
            times, held = [], []
            for _ in range(STEPS):
                t0 = time.perf_counter()
                tr.step(*a, **k)
                times.append(time.perf_counter() - t0)
                h = tr.held_bytes()
                held.append(h["params"] + h["optimizer"] + tr.message_bytes())
            tr.finish()
            dist.barrier()
            rows.append((rnd, zero, statistics.median(times), max(held), plan.step_time_s, plan.peak_memory_bytes,
                         plan.memory_breakdown.params + plan.memory_breakdown.optimizer + plan.memory_breakdown.grads))
    return rows


def main() -> None:
    from tests.harness import run_world

    cases = plans()
    per_rank = run_world(WORLD, measure, cases, timeout=1200)
    print(f"{MODEL}, batch {BATCH}, {STAGES} stages, dp=4 CDP v1, AdamW, 4 gloo ranks; slowest rank's median of {STEPS} steps, {ROUNDS} interleaved rounds")
    print("| ZeRO | step (round 1, 2) | held between steps, most of a rank |")
    print("|---|---|---|")
    for zero, _ in cases:
        rs = [[r for r in rows if r[1] == zero] for rows in per_rank]
        steps = [max(rank_rows[i][2] for rank_rows in rs) for i in range(ROUNDS)]
        held = max(r[3] for rank_rows in rs for r in rank_rows)
        print(f"| {zero} | {', '.join(f'{s * 1e3:.1f} ms' for s in steps)} | {held / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()
