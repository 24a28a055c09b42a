"""The project's data parallelism and ZeRO against PyTorch's own, side by side (figures, not a test).

    python benchmarks/vs_pytorch.py [--world 4] [--steps 10] [--warmup 3] [--cases dp,zero1,zero2,zero3,zero3-min,tp,dp2tp2,3d]
                                    [--hardware FILE.json|PRESET]

On ``--world`` gloo ranks of this host: the project's GPT (4 layers, hidden 384, 8 heads, seq 128,
vocab 2048, 8.7 M parameters), float32, AdamW, global batch 16. Each case trains the same
initialisation on the same batches two ways, the plan the planner makes for the configuration
(``auto_parallelize``'s runtime: ``compile_plan``) and the tool a PyTorch user would pick:

    dp     ZeRO-0 over dp=world  vs  DistributedDataParallel (25 MiB buckets)
    zero1  ZeRO-1                vs  DDP + ZeroRedundancyOptimizer(AdamW)
    zero2  ZeRO-2                vs  FSDP2 fully_shard per block + root, reshard_after_forward=False
    zero3      ZeRO-3, the fastest plan (keeps the gathered parameters for backward)
                             vs  FSDP2 fully_shard per block + root, reshard_after_forward=False
    zero3-min  ZeRO-3, the least-memory plan (frees them after forward, gathers them again in backward)
                             vs  FSDP2 fully_shard per block + root (reshard_after_forward=True, its default)
    tp     Megatron 1-D over tp=world (the model untied: embedding and head apart)
                             vs  parallelize_module: Colwise/Rowwise, vocab-parallel embedding, loss_parallel
    dp2tp2 dp=2 x Megatron tp=2 (untied)
                             vs  the same parallelize_module plan on the inner dim of a 2-D DeviceMesh, DDP over the outer
    3d     3-D tensor parallelism (Bian et al.) on a 2 x 2 x 2 cube, always on 8 ranks (untied): the fastest
           3-D plan within the memory the planner predicts for PyTorch's side (Megatron 1-D over tp=8, the
           layout parallelize_module runs), so both sides get the same memory and the time is compared
                             vs  PyTorch's nearest: parallelize_module's Megatron plan over tp=8 (PyTorch has no 3-D TP)

The 3-D row is planned under that budget because which 3-D plan is fastest moves with the calibration
on this shared host: with a fast link fit the unconstrained fastest replicates the residual stream
(measured 1.05 in time and 1.57 in memory in one run), with the cpu-gloo preset it shards everything.

The plans are made for this host: with ``--hardware`` a profile file or preset, by default one
``planner calibrate --quick`` measures first (on gloo a reduce-scatter costs about an all-reduce,
so ZeRO-1 sums by all-reduce here, as ZeroRedundancyOptimizer's side does).

Step time: warm-up steps, then ``--steps`` steps of each side interleaved (ours, theirs, ours,
...), each step timed on the slowest rank (the maximum over ranks after a barrier); the median.
Peak memory, by one method for both (the CPU allocator's count of live bytes, from every thread:
tests/memory_probe.py): one side built at a time in a fresh state, the largest count during a
step after the warm-up, less the count before the side was built, on rank 0. The first step's
losses of both sides are compared (they train the same model on the same data).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.harness spawns and reaps the ranks
from tests.harness import run_world

CONFIG = GPTConfig(n_layer=4, n_head=8, n_embd=384, block_size=128, vocab_size=2048)
# tensor parallelism: the same model with its embedding and head untied (parallelize_module cannot
# shard one parameter for two modules); both sides train this one
CONFIG_TP = dataclasses.replace(CONFIG, tie_embeddings=False)
GLOBAL_BATCH = 16
LR = 1e-3
CASES = {"dp": (0, "time"), "zero1": (1, "time"), "zero2": (2, "time"), "zero3": (3, "time"), "zero3-min": (3, "memory"),
         "tp": (0, "time"), "dp2tp2": (0, "time"), "3d": (0, "time")}  # ZeRO stage, objective
WORLDS = {"3d": 8}  # cases on their own number of ranks (the others: --world)
BASELINES = {"dp": "DDP", "zero1": "DDP + ZeroRedundancyOptimizer", "zero2": "FSDP2 (no reshard after forward)",
             "zero3": "FSDP2 (no reshard after forward)", "zero3-min": "FSDP2", "tp": "parallelize_module",
             "dp2tp2": "parallelize_module + DDP", "3d": "parallelize_module tp=8"}


def config(case: str) -> GPTConfig:
    return CONFIG_TP if case in ("tp", "dp2tp2", "3d") else CONFIG


def make_model(case: str = "dp") -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(config(case))
    model.reset_parameters()
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size), generator=g)
    return idx, torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size), generator=g)


def plan_json(world: int, case: str, hardware: Any) -> str:
    from planner.config import SearchConfig
    from planner.search import search
    from planner.trace import trace

    graph = trace(make_model(case), batch(0), {})
    zero, objective = CASES[case]
    if case == "3d":  # the fastest 3-D plan within the memory the planner prices PyTorch's side at (see the docstring)
        from tests.test_same_math import megatron

        theirs = search(graph, SearchConfig(devices=world, dp=1, tp=("1d",), hardware=hardware, front=False), model_name="gpt-bench", allow=megatron)
        assert theirs.best is not None
        config = SearchConfig(devices=world, dp=1, tp=("3d",), hardware=hardware, front=False, memory_budget=theirs.best.peak_memory_bytes)
        result = search(graph, config, model_name="gpt-bench")
    elif case in ("tp", "dp2tp2"):  # Megatron 1-D (inside data parallelism), as parallelize_module's Colwise/Rowwise plan below
        from tests.test_same_math import megatron, megatron_dp

        dp = 1 if case == "tp" else 2
        config = SearchConfig(devices=world, dp=dp, tp=("1d",), hardware=hardware, front=False)
        result = search(graph, config, model_name="gpt-bench", allow=megatron if dp == 1 else megatron_dp)
    else:
        config = SearchConfig(devices=world, dp=world, tp=("none",), zero=(zero,), hardware=hardware, front=False, objective=objective)  # type: ignore[arg-type]
        result = search(graph, config, model_name="gpt-bench")
    assert result.best is not None and result.best.zero_stage == zero, [c.reason for c in result.candidates]
    return result.best.model_dump_json()


Step = Callable[[int], float]  # step number -> this rank's loss


def ours(text: str, case: str = "dp") -> tuple[Step, Any]:
    from planner.plan import Plan
    from planner.runtime.compile import compile_plan

    pm = compile_plan(Plan.model_validate_json(text), make_model(case), batch(0), {})
    opt = pm.make_optimizer(torch.optim.AdamW, lr=LR)

    def step(k: int) -> float:
        local_args, local_kwargs = pm.shard_batch(*batch(k))
        loss = pm(*local_args, **local_kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # the global loss

    return step, (pm, opt)


def _tensor_parallel(model: torch.nn.Module, world: int, dp: int = 1) -> tuple[torch.nn.Module, Any]:
    """Megatron 1-D with PyTorch's DTensor over the inner ``world // dp`` ranks: q/k/v and fc
    column-parallel, out and proj row-parallel, the embedding vocab-parallel, the head
    column-parallel into loss_parallel. Returns the module and its 2-D mesh (dp, tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    plan: dict[str, Any] = {"wte": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(CONFIG_TP.n_layer):
        plan |= {f"h.{i}.attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"h.{i}.attn.out_proj": RowwiseParallel(), f"h.{i}.mlp.fc": ColwiseParallel(), f"h.{i}.mlp.proj": RowwiseParallel()}
    return parallelize_module(model, mesh["tp"], plan), mesh


def theirs(case: str, rank: int, world: int) -> tuple[Step, Any]:
    model = make_model(case)
    rows = GLOBAL_BATCH // world
    opt: Any
    if case in ("tp", "dp2tp2", "3d"):
        from torch.distributed.tensor.parallel import loss_parallel

        dp = 2 if case == "dp2tp2" else 1
        module, mesh = _tensor_parallel(model, world, dp)
        if dp > 1:  # DDP over the data-parallel dim of the 2-D mesh, TP inside
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(module, device_mesh=mesh["dp"])
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        part = GLOBAL_BATCH // dp
        me = mesh["dp"].get_local_rank()

        def tp_step(k: int) -> float:
            idx, targets = batch(k)  # each data-parallel group computes its part of the batch, its share of each layer
            with loss_parallel():
                loss = module(idx[me * part:(me + 1) * part], targets[me * part:(me + 1) * part])
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = loss.detach().full_tensor()
            if dp > 1:
                dist.all_reduce(out, group=mesh["dp"].get_group())
            return float(out) / dp

        return tp_step, (module, opt)
    if case in ("dp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        module: Any = DistributedDataParallel(model)
        if case == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            opt = torch.optim.AdamW(module.parameters(), lr=LR)
    else:
        from torch.distributed.fsdp import fully_shard

        reshard = case == "zero3-min"  # FSDP2's default: gathered parameters freed after forward, gathered again in backward
        for block in model.h:
            fully_shard(block, reshard_after_forward=reshard)
        module = fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(module.parameters(), lr=LR)

    def step(k: int) -> float:
        idx, targets = batch(k)
        loss = module(idx[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out = loss.detach().clone()
        dist.all_reduce(out)  # the global loss, as the plan's forward returns it (timed outside)
        return float(out) / world

    return step, (module, opt)


def _timed(step: Step, k: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(k)
    seconds = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def _peak(build: Callable[[], tuple[Step, Any]], warmup: int) -> int:
    """Bytes the side holds at its step's peak: the allocator's live count during a step (after
    ``warmup`` steps) less the count before the side was built."""
    from tests.memory_probe import allocator_count, peak_count

    gc.collect()
    before = allocator_count()
    step, keep = build()
    for k in range(warmup):
        step(k)
    gc.collect()  # what building left in reference cycles (a traced copy of the model) is not the step's
    dist.barrier()
    peak = peak_count(lambda: step(warmup))
    del keep
    gc.collect()
    return peak - before


def compare(rank: int, world: int, cases: list[tuple[str, str]], steps: int, warmup: int) -> list[dict[str, Any]]:
    from tests.memory_probe import counting_every_thread

    rows = []
    for case, text in cases:
        mine, keep_mine = ours(text, case)
        other, keep_other = theirs(case, rank, world)
        first = (mine(0), other(0))
        for k in range(1, warmup):
            mine(k)
            other(k)
        t_mine, t_other = [], []
        for k in range(warmup, warmup + steps):
            t_mine.append(_timed(mine, k))
            t_other.append(_timed(other, k))
        del mine, other, keep_mine, keep_other
        gc.collect()
        with counting_every_thread():
            m_mine = _peak(lambda text=text, case=case: ours(text, case), warmup)
            m_other = _peak(lambda case=case: theirs(case, rank, world), warmup)
        rows.append({"case": case, "ours_s": statistics.median(t_mine), "theirs_s": statistics.median(t_other),
                     "ours_peak": m_mine, "theirs_peak": m_other, "loss": first})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--hardware", default=None, help="a profile file or preset to plan for (default: planner calibrate --quick first)")
    a = p.parse_args()
    from planner.hardware import load_profile

    if a.hardware:
        hardware = load_profile(a.hardware)
    else:
        from planner.runtime.calibrate import calibrate

        hardware = calibrate(quick=True, world=a.world)
    print(f"planning for {hardware.name}", flush=True)
    names = a.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {','.join(CASES)}")
    by_world: dict[int, list[str]] = {}
    for c in names:
        by_world.setdefault(WORLDS.get(c, a.world), []).append(c)
    rows = []
    for world, group in by_world.items():
        t0 = time.perf_counter()
        cases = [(c, plan_json(world, c, hardware)) for c in group]
        print(f"planned {len(cases)} cases in {time.perf_counter() - t0:.0f} s; running on {world} gloo ranks "
              f"({a.warmup} warm-up + {a.steps} timed steps per side, interleaved)", flush=True)
        rows += [dict(row, world=world) for row in run_world(world, compare, cases, a.steps, a.warmup, timeout=3600)[0]]
    print(f"\n{'configuration':56s} {'ours':>9s} {'theirs':>9s} {'time ratio':>10s} {'ours peak':>11s} {'theirs peak':>11s} {'mem ratio':>9s}  first losses")
    for row in sorted(rows, key=lambda r: names.index(r["case"])):
        label = f"{row['case']} vs {BASELINES[row['case']]} ({row['world']} ranks)"
        print(f"{label:56s} {row['ours_s'] * 1e3:7.0f}ms {row['theirs_s'] * 1e3:7.0f}ms {row['ours_s'] / row['theirs_s']:10.2f} "
              f"{row['ours_peak'] / 2**20:9.1f}MB {row['theirs_peak'] / 2**20:9.1f}MB {row['ours_peak'] / row['theirs_peak']:9.2f}  "
              f"{row['loss'][0]:.6f} / {row['loss'][1]:.6f}")


if __name__ == "__main__":
    main()
