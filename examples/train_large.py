"""Train a model that does not fit one device, end to end: build it on the meta device, plan it,
give each rank only its shards (initialised as one CPU would, or read from weights on disk),
train, checkpoint shard by shard, resume.

    # 4 CPU processes with gloo (no GPU needed):
    torchrun --nproc-per-node 4 examples/train_large.py --out run
    # again: it resumes from run/ckpt where it stopped (any plan, any world size):
    torchrun --nproc-per-node 2 examples/train_large.py --out run
    # survive a crash: torchrun restarts every process, which resume from the newest checkpoint
    # (--crash-at 7 kills rank 1 in the middle of step 7 on the first attempt, to try it; the variable gives
    # each attempt a fresh store: a shared one can hand restarted gloo ranks old addresses, pytorch#135712):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 --max-restarts 3 \\
        examples/train_large.py --out run --crash-at 7
    # start from a Hugging Face checkpoint (save_pretrained's folder: safetensors, sharded or not):
    torchrun --nproc-per-node 4 examples/train_large.py --model hf-llama --weights path/to/folder --out run
    # 2 nodes x 8 GPUs (NCCL): the same command on every node, K = 0 and 1
    torchrun --nnodes 2 --node-rank K --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_large.py --backend nccl --zero 3 --out run

Rank 0 plans (``auto_parallelize``; ``--zero``, ``--objective``), every rank compiles that plan on
the meta model: its shards only, so no rank ever holds the whole model. Batch ``k`` is the same
on every launch (seeded by k), and the checkpoint holds the step counter and the losses so far, so
a resumed run (after a stop, or a crash and torchrun's restart) continues the uninterrupted one
exactly. ``--losses FILE`` writes every step's loss as JSON (rank 0). ``--timeout`` is the
process group's: a rank that stalls longer fails the others with a message naming it and the
collective (runtime/faults.py), and torchrun restarts the world.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from planner import auto_parallelize
from planner.models import build_model, example_inputs
from planner.runtime.checkpoint import load_checkpoint, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-tiny", help="a preset of `planner models`")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--zero", type=int, default=3, help="the ZeRO stage to plan with (3: parameters sharded too)")
    parser.add_argument("--objective", choices=("time", "memory", "knee"), default="memory")
    parser.add_argument("--tp", default="none,1d,2d,3d", help="tensor-parallel families to search")
    parser.add_argument("--dp", type=int, default=None, help="pin the data-parallel degree")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    parser.add_argument("--weights", default=None, help="safetensors file or folder, or a checkpoint, to start from")
    parser.add_argument("--out", default="run", help="folder of the checkpoint (out/ckpt)")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--resume", nargs="?", const="yes", choices=("auto", "yes", "no"), default="auto",
                        help="continue from out/ckpt: auto (where it exists), yes (it must), no (start over, overwriting it)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective waits for a stalled rank before failing")
    parser.add_argument("--crash-at", type=int, default=None, help="kill rank 1 in the middle of this step on the first attempt")
    parser.add_argument("--losses", default=None, help="write the losses here (JSON, rank 0)")
    args = parser.parse_args()
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    device = None
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)  # what a CPU build would draw from: each rank's shards are its slices
    model = build_model(args.model, device="meta", dtype=dtype, seed=None)
    batch_args, batch_kwargs = example_inputs(args.model, batch=args.batch, dtype=dtype)
    search = {"tp": tuple(args.tp.split(","))} | ({"dp": args.dp} if args.dp else {})
    pm = auto_parallelize(model, world, batch_args, example_kwargs=batch_kwargs, zero=(args.zero,), objective=args.objective,
                          weights=args.weights, device=device, **search)
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
    ckpt = Path(args.out) / "ckpt"
    start, losses = 0, {}
    if args.resume == "yes" or (args.resume == "auto" and ckpt.exists()):
        progress = load_checkpoint(pm, optimizer, ckpt)
        start, losses = progress["step"], {int(k): v for k, v in progress["extra"].get("losses", {}).items()}
    if rank == 0:
        held = sum(p.numel() * p.element_size() for p in pm.parameters())
        print(f"plan: mesh {pm.plan.mesh}, tp {pm.plan.tp}, ZeRO-{pm.plan.zero_stage}; this rank holds {held / 2**20:.2f} MiB of parameters; "
              f"predicted peak {pm.plan.peak_memory_bytes / 2**20:.1f} MiB/device; starting at step {start} "
              f"(attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)
    for step in range(start, args.steps):
        full_args, full_kwargs = example_inputs(args.model, batch=args.batch, dtype=dtype, seed=1000 + step)
        local_args, local_kwargs = pm.shard_batch(*full_args, **full_kwargs)
        loss = pm(*local_args, **local_kwargs)
        if step == args.crash_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os._exit(1)  # a crash between forward and backward: the others fail in backward's collectives
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = loss.item()
        if rank == 0:
            print(f"step {step}: loss {losses[step]:.6f}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_checkpoint(pm, optimizer, ckpt, step=step + 1, extra={"losses": losses})
    if rank == 0 and args.losses:
        Path(args.losses).write_text(json.dumps(losses))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
