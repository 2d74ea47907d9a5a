"""The hand-written DDP script ``benchmarks/launch.py`` runs under torchrun.

    torchrun --nproc-per-node 2 benchmarks/ddp_digits.py --steps 100

The quickstart's job written by hand: the digits CNN, uint8 images normalised in the
step, DDP over gloo, bf16 autocast, AdamW with clipping, batch 32 per worker. It
prints the wall clock (``time.time()``) at its first optimizer step and at its end.
``train`` is the job itself, once a process group is up: ``ray_train_digits.py`` runs
the same function under a bare Ray Train ``TorchTrainer``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from raylift.tasks.digits import DigitsNet


def parse_args(per: str = "process") -> argparse.Namespace:
    """The job's settings, the same under torchrun and under Ray Train."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--cuda", action="store_true", help=f"one GPU per {per}, NCCL")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    train(args.steps, args.batch_size, args.cuda)
    dist.destroy_process_group()


def train(steps: int, batch_size: int, cuda: bool) -> None:
    """The job on this rank of an initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy((digits.images * 255 // 16).astype(np.uint8)).to(device)
    labels = torch.from_numpy(digits.target.astype(np.int64)).to(device)
    torch.manual_seed(0)
    model = DistributedDataParallel(DigitsNet(32, 0.1).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator(device).manual_seed(rank)
    b = batch_size
    for step in range(steps):
        idx = torch.randint(len(labels), (b,), generator=gen, device=device)
        x = images[idx].float().div_(255).sub_(0.3045).div_(0.3760).unsqueeze(1)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), labels[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0 and rank == 0:
            float(loss)  # the step is done on the device too
            print(f"first_step_at {time.time():.3f}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"finished_at {time.time():.3f} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
