"""Train gpt-tiny with a plan found by the planner, on any number of processes.

    # 4 CPU processes with gloo (no GPU needed):
    torchrun --nproc-per-node 4 examples/train_gpt_tiny.py
    # 8 GPUs on one node (NCCL):
    torchrun --nproc-per-node 8 examples/train_gpt_tiny.py --backend nccl
    # 2 nodes x 8 GPUs:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/train_gpt_tiny.py --backend nccl

Every rank plans (planning is deterministic, so all ranks agree), compiles its shard of the
model, and feeds its data-parallel slice of each global batch. ``--objective memory`` asks for the
most memory-frugal plan instead of the fastest.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from models import build_model, example_inputs
from planner import auto_parallelize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--objective", choices=("time", "memory"), default="time")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank()
    model = build_model("gpt-tiny", seed=0)
    batch_args, batch_kwargs = example_inputs("gpt-tiny", batch=args.batch)
    pm = auto_parallelize(model, dist.get_world_size(), batch_args, example_kwargs=batch_kwargs, objective=args.objective)
    if rank == 0:
        print(f"plan: mesh {pm.plan.mesh}, tp {pm.plan.tp}, predicted {pm.plan.peak_memory_bytes / 2**20:.1f} MiB/device")
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=3e-3)
    for step in range(args.steps):
        full_args, full_kwargs = example_inputs("gpt-tiny", batch=args.batch, seed=step % 4)
        local_args, local_kwargs = pm.shard_batch(*full_args, **full_kwargs)
        loss = pm(*local_args, **local_kwargs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
