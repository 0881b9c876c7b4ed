"""A curriculum: train on one task for some steps, then switch to the next.

GRPO learns only from groups whose rewards differ (`informative` > 0). A policy that fails every
GSM8K problem gets all-zero groups and no gradient, so a run can start on problems it can already
partly solve (arithmetic) and move on to the real task once it earns reward there.

A curriculum is a list of stages, each `{task, steps, <load options>}`:

    curriculum:                       # YAML
      - {task: arithmetic, steps: 50, levels: "1,2"}
      - {task: gsm8k, steps: 200, data_files: ../shared/data/gsm8k/train.jsonl}

or on the command line `--curriculum arithmetic:50,gsm8k:200`. Stage i covers the `steps` training
steps after those of the stages before it; after the last stage's steps the last stage continues.

Held-out evaluation (before training, every `eval_steps`, after training) is on the last stage's task: the task
the curriculum leads to, the same problems before and after, whatever `task` is. `cohort-grpo train` loads that
task's held-out rows (its test split, or `eval_data_files`; the stage's `levels` where it gives them) and the
trainer scores `eval_dataset` with that task's verifier (`held_out_task`).

Rewards: each stage brings its task's reward functions (a `RewardRunner` per stage, switched with the
prompts), so no function ever scores another task's rows. A trainer given explicit `reward_funcs`
keeps those for every stage instead. Load options not given in a stage come from the run's config
(seed, levels, subset; data_files only for the stage whose task is the run's `task`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cohort_grpo.config.curriculum import Stage, stages_of
from cohort_grpo.errors import CohortError


@dataclass
class StageSwitch:
    """Entering a stage: its rows, its reward runner (None: keep the current one), a line for the log."""

    rows: list[dict]
    rewards: object | None
    message: str


class Curriculum:
    """Switches a `GRPOTrainer`'s prompt source (and reward functions) between stages.

    The trainer calls `enter(step, tokenizer)` at the start of each step's prompt selection and
    takes the `StageSwitch` it returns, if any; it adds `metrics()` to the step's record
    (`curriculum/stage`, 0-based)."""

    def __init__(self, stages: list[dict] | list[Stage], args, keep_rewards: bool = False):
        self.stages = stages_of([s.to_dict() if isinstance(s, Stage) else s for s in stages])
        self.args = args
        self.keep_rewards = keep_rewards
        self.index: int | None = None  # the stage in force; None before the first step
        self.task = None  # that stage's task object (its verifier counts `success`)
        self._runners: dict[int, object] = {}

    @classmethod
    def from_config(cls, args, keep_rewards: bool = False) -> "Curriculum | None":
        return cls(args.curriculum, args, keep_rewards) if args.curriculum else None

    @property
    def held_out_stage(self) -> Stage:
        """The stage whose task the run's held-out evaluation measures: the last one, where the curriculum leads."""
        return self.stages[-1]

    def held_out_task(self):
        """The task object of `held_out_stage` (its verifier scores the held-out rows)."""
        from cohort_grpo.tasks import get_task

        return get_task(self.held_out_stage.task)

    def stage_at(self, step: int) -> int:
        """0-based stage of a 1-based training step; past the end, the last stage."""
        end = 0
        for i, stage in enumerate(self.stages):
            end += stage.steps
            if step <= end:
                return i
        return len(self.stages) - 1

    def enter(self, step: int, tokenizer) -> "StageSwitch | None":
        """The stage of `step`, when the run is not in it yet: its training rows and, unless the
        user's own reward functions are kept, its reward runner. None when nothing changes."""
        index = self.stage_at(max(1, step))
        if index == self.index:
            return None
        from cohort_grpo.tasks import get_task

        stage = self.stages[index]
        self.task = get_task(stage.task)
        rows = self.task.load("train", tokenizer=tokenizer, **self._load_options(stage))  # token filters
        if not rows:
            raise CohortError(f"curriculum stage {index + 1} ({stage.task}) has no training rows; check its options")
        rewards = None
        if not self.keep_rewards:
            if self.index is not None and self.index in self._runners:
                self._runners[self.index].close()  # its worker processes restart if the stage comes back
            rewards = self._runner(index)
        self.index = index
        return StageSwitch(rows, rewards, f"curriculum: stage {index + 1}/{len(self.stages)} ({stage.task}, "
                                          f"{stage.steps} steps) from step {max(1, step)}")

    def switch(self, step: int, tokenizer, prompts, rewards, log: Callable[[str], None]):
        """At a stage boundary (`enter`): the stage's rows into `prompts` (the run's `PromptStream`), its message
        logged; the reward runner from `step` on (`rewards` itself unless the stage brings its own), checked
        against the rows' columns."""
        switch = self.enter(step, tokenizer)
        if switch is None:
            return rewards
        prompts.switch_rows(switch.rows)
        if switch.rewards is not None:
            rewards = switch.rewards
        rewards.check_columns(set(switch.rows[0]))
        log(switch.message)
        return rewards

    def metrics(self) -> dict[str, float]:
        return {"curriculum/stage": float(self.index if self.index is not None else 0)}

    def _runner(self, index: int):
        if index not in self._runners:
            from cohort_grpo.rewards.runner import RewardRunner

            self._runners[index] = RewardRunner(list(self.task.reward_funcs), list(self.task.reward_weights),
                                                timeout_s=self.args.reward_timeout, errors=self.args.reward_errors)
        return self._runners[index]

    def _load_options(self, stage: Stage) -> dict:
        args = self.args
        options = {"seed": args.seed, "levels": args.levels, "subset": args.subset}
        if stage.task == args.task and args.data_files is not None:
            options["data_files"] = args.data_files
        options.update(stage.options)
        return {k: v for k, v in options.items() if v is not None}
