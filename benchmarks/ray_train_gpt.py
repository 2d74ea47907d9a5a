"""gpt-tiny's shape under a bare Ray Train ``TorchTrainer``, with checkpoints of its own and
``FailureConfig``: the restart floor of Ray Train alone, for ``benchmarks/goodput.py``.

    RAY_ADDRESS=... python benchmarks/ray_train_gpt.py --steps 1200 --every 50 --progress FILE

A byte-level GPT of gpt-tiny's size (3 layers, d_model 128, 4 heads, block 128, batch 16
per worker) in plain torch, on random bytes (the same batches for the same step), fp32,
AdamW, over gloo, one worker per CPU. Every ``--every`` steps rank 0 saves the model, the
optimizer and the step, and reports them to Ray Train; a restarted group resumes from the
newest. Rank 0 appends ``STEP WALLCLOCK`` to ``--progress`` after each step: the parent
times a restart from it. Nothing of raylift's is used.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from typing import Any

VOCAB, BLOCK, D_MODEL, LAYERS, HEADS, BATCH = 256, 128, 128, 3, 4, 16


def build_model() -> Any:
    import torch
    from torch import nn

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Parameter(torch.zeros(BLOCK, D_MODEL))
            layer = nn.TransformerEncoderLayer(
                D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, LAYERS)
            self.head = nn.Linear(D_MODEL, VOCAB)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(BLOCK))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) + self.pos
            return self.head(self.blocks(h, mask=self.mask, is_causal=True))

    return TinyGPT()


def batch(step: int, rank: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, BLOCK + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loop(config: dict[str, Any]) -> None:
    import ray.train
    import torch
    import torch.nn.functional as F

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(0)
    model: Any = ray.train.torch.prepare_model(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    device = ray.train.torch.get_device()
    while step < config["steps"]:
        x, y = (t.to(device) for t in batch(step, rank))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            with open(config["progress"], "a") as f:
                f.write(f"{step} {time.time()}\n")
        if step % config["every"] == 0 or step == config["steps"]:
            save(model, opt, step, rank, float(loss))


def save(model: Any, opt: Any, step: int, rank: int, loss: float) -> None:
    import ray.train
    import torch

    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
            torch.save(state, os.path.join(d, "state.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--storage", default=None)
    parser.add_argument("--cuda", action="store_true", help="a GPU per worker, over NCCL")
    args = parser.parse_args()
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", logging_level=logging.ERROR)
    trainer = TorchTrainer(
        loop,
        train_loop_config={"steps": args.steps, "every": args.every, "progress": args.progress},
        torch_config=TorchConfig(backend="nccl" if args.cuda else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=2, use_gpu=args.cuda, resources_per_worker={"CPU": 1}
        ),
        run_config=RunConfig(
            storage_path=args.storage or tempfile.mkdtemp(prefix="rl-bare-gpt-"),
            failure_config=FailureConfig(max_failures=4),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
