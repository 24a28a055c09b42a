"""Train gpt-tiny with a plan found by the planner, on any number of processes.

    # 4 CPU processes with gloo (no GPU needed):
    torchrun --nproc-per-node 4 examples/train_gpt_tiny.py
    # 8 GPUs on one node (NCCL):
    torchrun --nproc-per-node 8 examples/train_gpt_tiny.py --backend nccl
    # 2 nodes x 8 GPUs:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/train_gpt_tiny.py --backend nccl

Rank 0 plans for the hardware this runs on and every rank runs that plan (``auto_parallelize``
under a process group): it compiles its shard of the model and feeds its data-parallel slice of
each global batch. The hardware profile is ``cpu-gloo`` under gloo, the preset of the GPU's name
under NCCL (H100, H200, A100 80/40 GB, V100), or a file of ``planner calibrate`` (``--hardware``):
planning gloo ranks on a CPU as A100s would price communication 1000x too cheap. The global batch
defaults to 32 rows per process, enough work that sharding pays on this 2-core CPU host (at 8
rows gpt-tiny is too small: the planner would say its best plan shards nothing, and prints so).
``--objective memory`` asks for the most memory-frugal plan instead of the fastest.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from planner import auto_parallelize
from planner.models import build_model, example_inputs


def gpu_preset() -> str:
    """The hardware preset of this process's GPU, by its name and memory (A100 80 GB where unknown)."""
    name = torch.cuda.get_device_name()
    gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    for key, preset in (("H200", "h200-141g"), ("H100", "h100-80g"), ("V100", "v100-16g"), ("A100", "a100-80g" if gib > 45 else "a100-40g")):
        if key in name:
            return preset
    print(f"no preset for {name}: planning as a100-80g; `planner calibrate` writes a profile of this machine for --hardware")
    return "a100-80g"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default 32 per process)")
    parser.add_argument("--hardware", default=None, help="a preset or a `planner calibrate` file (default: what this runs on)")
    parser.add_argument("--objective", choices=("time", "memory"), default="time")
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank()
    args.batch = args.batch or 32 * dist.get_world_size()
    hardware = args.hardware or (gpu_preset() if args.backend == "nccl" else "cpu-gloo")
    model = build_model("gpt-tiny", seed=0)
    batch_args, batch_kwargs = example_inputs("gpt-tiny", batch=args.batch)
    pm = auto_parallelize(model, dist.get_world_size(), batch_args, example_kwargs=batch_kwargs, objective=args.objective, hardware=hardware)
    if rank == 0:
        print(f"plan for {hardware}: mesh {pm.plan.mesh}, tp {pm.plan.tp}, ZeRO {pm.plan.zero_stage}, predicted "
              f"{pm.plan.step_time_s * 1e3:.1f} ms/step, {pm.plan.peak_memory_bytes / 2**20:.1f} MiB/device")
        if pm.plan.shards_nothing:
            print(pm.plan.shards_nothing_note())
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
