"""`Checkpointing`: the checkpoints of a training run as a stage — saving one, resuming from one, noting the last
completed step for the one a failure writes.

It keeps the objects a checkpoint saves and restores in place that last the whole run (the policy, π_ref, the
optimizer, ...). What changes during a run is handed to each call: the config (`train(resume_from_checkpoint=...)`
replaces it), the reward functions (a curriculum stage swaps them) and the run's plain values (`RunState`). Each
call returns its result: the folder written, the `RunState` a resume loaded, the `StepEnd` noted. The folder
format is checkpoint.py's (writing) and checkpoint_load.py's (reading); when a checkpoint is due, signals and the
failure's checkpoint are lifecycle.py's and failure.py's, which call back into `save` and `note_step_end` through
the trainer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, ContextManager

from cohort_grpo.run.assembly import RunAssembly
from cohort_grpo.run.checkpoint import RunParts, RunState, save_checkpoint
from cohort_grpo.run.failure import StepEnd, note_step_end
from cohort_grpo.run.lifecycle import RunLifecycle


class Checkpointing:
    """The run's checkpoints. `extra_state()` / `load_extra_state(state)`: what a trainer keeps beyond the model,
    optimizer and data order (the rollouts sampled ahead, PPO's critic), None when it keeps nothing more."""

    def __init__(self, *, model, tokenizer, train_model, optimizer, scheduler, ref_model,
                 reference_pass: Callable[..., ContextManager], parallel, engine_copy,
                 extra_state: Callable[[], dict | None], load_extra_state: Callable[[dict], None]):
        self.objects: dict[str, Any] = dict(
            model=model, tokenizer=tokenizer, train_model=train_model, optimizer=optimizer, scheduler=scheduler,
            ref_model=ref_model, reference_pass=reference_pass, parallel=parallel, engine_copy=engine_copy,
            extra_state=extra_state, load_extra_state=load_extra_state)

    @classmethod
    def of_run(cls, run: RunAssembly, extra_state: Callable[[], dict | None],
               load_extra_state: Callable[[dict], None]) -> "Checkpointing":
        """The checkpoints of the run `assemble_run` built."""
        return cls(model=run.model, tokenizer=run.tokenizer, train_model=run.train_model, optimizer=run.optimizer,
                   scheduler=run.scheduler, ref_model=run.ref_model, reference_pass=run.memory.reference_pass,
                   parallel=run.parallel, engine_copy=run.engine_copy, extra_state=extra_state,
                   load_extra_state=load_extra_state)

    def parts(self, args, reward_funcs: list) -> RunParts:
        """What a checkpoint saves and loads: the run's objects, with the config and reward functions in use now."""
        return RunParts(args=args, reward_funcs=reward_funcs, **self.objects)

    def save(self, args, reward_funcs: list, run_state: Callable[[], RunState], step_end: StepEnd | None = None) -> Path:
        """checkpoint-<step> of the run as it is now, its plain values `run_state()` (asked for once the trainer's extra
        state is handed over); with `step_end`: of the step it noted, with that step's reward functions and the
        weights as they are now (a failure in the next step, before its update: cohort_grpo/run/failure.py).
        Returns its folder."""
        parts = self.parts(args, reward_funcs if step_end is None else step_end.reward_funcs)
        saved = parts.extra_state()  # on every rank: with rollouts sampled ahead, every rank hands over its
        parts = dataclasses.replace(parts, extra_state=lambda: saved)  # own (a collective) and rank 0 writes them
        return save_checkpoint(parts, run_state() if step_end is None else step_end.state)

    def note_step_end(self, state: RunState, args, reward_funcs: list, optimizer_steps: int,
                      sampled_ahead: dict | None = None) -> StepEnd:
        """The run at the end of a step (its plain values `state`, the optimizer steps taken so far, the rollouts
        sampled ahead then), noted in memory with the RNG states and the logs' sizes for the checkpoint a failure in
        the next step writes."""
        return note_step_end(state, Path(args.output_dir), reward_funcs, optimizer_steps, args.async_rollouts,
                             sampled_ahead)

    def resume(self, run: RunLifecycle, reward_funcs: Callable[[], list],
               enter_stage: Callable[[int], None]) -> RunState | None:
        """Load the checkpoint `run` continues (its config's --resume / resume_from_checkpoint) into the run's objects,
        in place, and return its plain values; None to start from step 0. `enter_stage(step)` enters the
        checkpoint's curriculum stage first, so `reward_funcs()` is asked for the stage's reward functions after it."""
        return run.resume(lambda: self.parts(run.args, reward_funcs()), enter_stage)
