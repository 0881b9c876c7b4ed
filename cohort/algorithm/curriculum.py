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

Rewards: each stage brings its task's reward functions (a `RewardRunner` per stage, switched with the
prompts), so no function ever scores another task's rows. A trainer given explicit `reward_funcs`
keeps those for every stage instead. Load options not given in a stage come from the run's config
(seed, levels, subset; data_files only for the stage whose task is the run's `task`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CohortError

LOAD_OPTIONS = ("levels", "data_files", "subset", "seed", "size", "max_prompt_tokens", "max_answer_tokens")


@dataclass
class Stage:
    task: str
    steps: int
    options: dict = field(default_factory=dict)  # passed to task.load("train", ...)

    def to_dict(self) -> dict:
        return {"task": self.task, "steps": self.steps, **self.options}


def parse_curriculum(raw) -> list[dict] | None:
    """A curriculum from YAML (a list of mappings) or the compact CLI form `arithmetic:50,gsm8k:200`,
    as a list of plain dicts {task, steps, ...} (the config keeps plain data); checked by `stages_of`."""
    if raw is None or raw == "" or raw == []:
        return None
    if isinstance(raw, str):
        stages = []
        for part in (p.strip() for p in raw.split(",")):
            task, sep, steps = part.partition(":")
            if not part or not sep or not task.strip():
                raise CohortError(f"curriculum stage {part!r} is not TASK:STEPS; write e.g. "
                                  "--curriculum arithmetic:50,gsm8k:200")
            stages.append({"task": task.strip(), "steps": steps.strip()})
        raw = stages
    if not isinstance(raw, list):
        raise CohortError(f"curriculum must be a list of stages {{task, steps}}, got {type(raw).__name__}; "
                          "e.g. --curriculum arithmetic:50,gsm8k:200")
    return [stage.to_dict() for stage in stages_of(raw)]


def stages_of(raw: list) -> list[Stage]:
    """Checked `Stage`s from a list of mappings; bad input raises a one-line `CohortError`."""
    from ..tasks import TASKS

    stages = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or "task" not in item or "steps" not in item:
            raise CohortError(f"curriculum stage {i + 1} ({item!r}) needs 'task' and 'steps', "
                              "e.g. {task: arithmetic, steps: 50}")
        task = str(item["task"])
        if task not in TASKS:
            raise CohortError(f"curriculum stage {i + 1}: unknown task {task!r}; choose one of {sorted(TASKS)}")
        try:
            steps = int(item["steps"])
        except (TypeError, ValueError):
            steps = 0
        if steps < 1 or str(item["steps"]).strip() != str(steps):
            raise CohortError(f"curriculum stage {i + 1} ({task}): steps must be a positive whole number, "
                              f"got {item['steps']!r}")
        unknown = sorted(set(item) - {"task", "steps"} - set(LOAD_OPTIONS))
        if unknown:
            raise CohortError(f"curriculum stage {i + 1} ({task}): unknown option(s) {unknown}; "
                              f"a stage takes task, steps and {list(LOAD_OPTIONS)}")
        stages.append(Stage(task, steps, {k: v for k, v in item.items() if k not in ("task", "steps")}))
    if not stages:
        raise CohortError("curriculum is empty; give at least one stage, e.g. --curriculum arithmetic:50")
    return stages


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
        from ..tasks import get_task

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

    def metrics(self) -> dict[str, float]:
        return {"curriculum/stage": float(self.index if self.index is not None else 0)}

    def _runner(self, index: int):
        if index not in self._runners:
            from ..rewards.runner import RewardRunner

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
