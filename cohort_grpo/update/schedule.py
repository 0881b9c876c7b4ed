"""The learning-rate schedule of the policy's optimizer: linear warm-up, then cosine, linear or constant.

It advances with real optimizer steps only (a skipped non-finite update does not count), as
transformers' Trainer does, and spans every one of the run: num_iterations (μ) of them a step, so max_steps × μ,
the warm-up warmup_steps × μ. The formulas are transformers' (`get_scheduler`, which TRL's trainer uses), the
warm-up's first update at 0 included.
"""

from __future__ import annotations

import math

import torch


def lr_scheduler(optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """`optimizer`'s schedule from `args` (warmup_steps, lr_scheduler_type, max_steps)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(args, step))


def lr_factor(args, step: int) -> float:
    """The learning rate's multiplier at optimizer step `step` (from 0): linear warm-up, then cosine, linear or
    constant."""
    updates, warmup = args.max_steps * args.num_iterations, args.warmup_steps * args.num_iterations
    if step < warmup:
        return step / warmup
    progress = min(1.0, (step - warmup) / max(1, updates - warmup))
    if args.lr_scheduler_type == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if args.lr_scheduler_type == "linear":
        return 1.0 - progress
    return 1.0
