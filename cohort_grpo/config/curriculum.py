"""A curriculum's stages, as the config holds them: `--curriculum arithmetic:50,gsm8k:200` or a YAML list of
`{task, steps, <load options>}` mappings, checked and turned into plain dicts when the config is validated.
The run switches between them with `cohort_grpo.tasks.curriculum.Curriculum`."""

from __future__ import annotations

from dataclasses import dataclass, field

from cohort_grpo.config.choices import task_path
from cohort_grpo.errors import CohortError

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
            task, sep, steps = part.rpartition(":")  # reasoning_gym:leg_counting:50
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
    stages = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or "task" not in item or "steps" not in item:
            raise CohortError(f"curriculum stage {i + 1} ({item!r}) needs 'task' and 'steps', "
                              "e.g. {task: arithmetic, steps: 50}")
        task = str(item["task"])
        try:
            task_path(task)
        except CohortError as error:
            raise CohortError(f"curriculum stage {i + 1}: {error}") from None
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
