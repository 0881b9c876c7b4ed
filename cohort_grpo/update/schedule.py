"""The learning-rate schedule of the policy's optimizer: linear warm-up, then cosine, linear or constant.

It advances with real optimizer steps only (a skipped non-finite update does not count), as
transformers' Trainer does.
"""

from __future__ import annotations

import math

import torch


def lr_scheduler(optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """`optimizer`'s schedule from `args` (warmup_steps, lr_scheduler_type, max_steps)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(args, step))


def lr_factor(args, step: int) -> float:
    """The learning rate's multiplier at optimizer step `step`: linear warm-up, then cosine, linear or constant."""
    if args.warmup_steps and step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    if args.lr_scheduler_type == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if args.lr_scheduler_type == "linear":
        return 1.0 - progress
    return 1.0
