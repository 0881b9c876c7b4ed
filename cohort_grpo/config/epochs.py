"""TRL's `num_train_epochs`: a run measured in passes over the training rows instead of steps."""

from __future__ import annotations

import dataclasses
import math

from cohort_grpo.errors import CohortError


def with_epoch_steps(args, rows: int, world_size: int = 1):
    """`args` with `max_steps` set from `num_train_epochs` (unchanged when that is None): each step draws
    `prompts_per_step` prompts on each of `world_size` ranks, so an epoch is `rows` ÷ that many steps,
    rounded up, as transformers counts a last partial batch as a step."""
    if args.num_train_epochs is None:
        return args
    if args.curriculum:
        raise CohortError(f"num_train_epochs={args.num_train_epochs} with a curriculum: each stage counts its own "
                          "steps; give the stages' steps and leave num_train_epochs unset")
    steps = math.ceil(args.num_train_epochs * rows / (args.prompts_per_step * world_size))
    return dataclasses.replace(args, max_steps=max(1, steps))
