"""The run's step counts as whole numbers of steps, settled once the run's length is known.

transformers (so TRL) takes `logging_steps`, `save_steps`, `eval_steps` and `warmup_steps` as a number of
steps or as a fraction of the run in (0, 1), which is ceil(fraction × max_steps) steps; `warmup_ratio` as
such a fraction where `warmup_steps` is 0; and `save_strategy` / `eval_strategy` `epoch` as once per pass
over the training rows. `with_step_counts` turns them all into whole counts once `max_steps` is known (after
`num_train_epochs`, cohort_grpo/config/epochs.py), so every stage reads integers: in the settled config
`save_strategy` and `eval_strategy` are `steps` or `no` and `warmup_ratio` is 0.
"""

from __future__ import annotations

import dataclasses
import math

from cohort_grpo.config.epochs import with_epoch_steps


def with_step_counts(args, rows: int, world_size: int = 1):
    """`args` with `max_steps` from `num_train_epochs` (if set) and every step count a whole number of steps;
    `rows` training rows drawn `prompts_per_step` at a time on each of `world_size` ranks make an epoch."""
    args = with_epoch_steps(args, rows, world_size)
    return dataclasses.replace(args, **step_counts(args, epoch_steps(args, rows, world_size)))


def epoch_steps(args, rows: int, world_size: int = 1) -> int:
    """Steps of one pass over `rows`, rounded up as `with_epoch_steps` counts them."""
    return max(1, math.ceil(rows / (args.prompts_per_step * world_size)))


def step_counts(args, steps_per_epoch: int) -> dict:
    """The settled values of the step-count options of `args` (whose `max_steps` is the run's)."""
    def count(value) -> int:
        return math.ceil(value * args.max_steps) if 0 < value < 1 else int(value)

    logging_steps = count(args.logging_steps)
    save_steps = {"steps": count(args.save_steps), "epoch": steps_per_epoch, "no": 0}[args.save_strategy]
    eval_strategy = args.eval_strategy or ("steps" if args.eval_steps else "no")
    # transformers: eval_strategy steps without eval_steps evaluates every logging_steps
    eval_steps = {"steps": count(args.eval_steps) or logging_steps, "epoch": steps_per_epoch, "no": 0}[eval_strategy]
    warmup_steps = count(args.warmup_steps) if args.warmup_steps else math.ceil(args.warmup_ratio * args.max_steps)
    return dict(logging_steps=logging_steps, log_completions_steps=count(args.log_completions_steps),
                save_strategy="no" if args.save_strategy == "no" else "steps", save_steps=save_steps,
                eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps,
                warmup_steps=warmup_steps, warmup_ratio=0.0)


def epoch_options(args) -> list[tuple[str, str]]:
    """The options of `args` that count passes over the training rows, as (the option as given, what to give
    instead) pairs: empty when the run counts steps only."""
    out = []
    if args.num_train_epochs is not None:
        out.append((f"num_train_epochs={args.num_train_epochs}", "set max_steps instead"))
    for name in ("save_strategy", "eval_strategy"):
        if getattr(args, name) == "epoch":
            out.append((f"{name}='epoch'", f"give {name.replace('strategy', 'steps')} instead"))
    return out
