"""`Toolbox`: what a run's rollouts may call (tool functions, an environment class) and the limits, made
once from the trainer's arguments, the config or the task; it renders the tools' schemas for prompts and
makes each rollout's `ToolTurns`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cohort_grpo.errors import CohortError
from cohort_grpo.tools.loading import resolve_environment, resolve_tools, tool_spec, unsaved_reason
from cohort_grpo.tools.schema import environment_tools, make_tools
from cohort_grpo.tools.turns import ToolTurns

TOOLS_FILE = "tools.json"  # beside a trained model: the tools it was trained with (`cohort-grpo chat`, `cohort-grpo eval`)


@dataclass
class Toolbox:
    tools: list
    environment_factory: object = None
    max_iterations: int | None = None
    timeout_s: float | None = 30.0
    template_kwargs: dict | None = None  # the run's chat_template_kwargs, for the tool turns
    environment_from_task: bool = False  # the task made the environment (and makes it again from its name)

    @property
    def plays_episodes(self) -> bool:
        """The environment speaks between the model's turns (verifiers, OpenEnv) rather than offering tools."""
        return callable(getattr(self.environment_factory, "episode_turns", None))

    def schemas(self, environment=None) -> list[dict] | None:
        """The tool schemas the chat template renders into the prompt (an environment's methods too)."""
        table = make_tools(list(self.tools) + (environment_tools(environment) if environment is not None else []))
        return [tool.schema for tool in table.values()] or None

    def turns(self, tokenizer, num_rows: int, environments=None) -> ToolTurns:
        """The turn handler of one rollout of `num_rows` completions: tool turns, or the environment's own
        episodes where its factory has `episode_turns` (cohort_grpo/tools/episodes.py)."""
        if self.plays_episodes and environments is not None:
            return self.environment_factory.episode_turns(tokenizer, environments, self.template_kwargs)
        return ToolTurns(tokenizer, self.tools, environments=environments, max_iterations=self.max_iterations,
                         timeout_s=self.timeout_s, num_rows=num_rows, template_kwargs=self.template_kwargs)

    def save(self, folder: str | Path) -> list[str]:
        """tools.json beside the model, so `cohort-grpo chat` and `cohort-grpo eval` offer the same tools (by import
        name); returns one warning line for each tool or environment that has no such name. An environment
        that plays episodes is no tool set and is not written: where the task made it, the task makes it again;
        else one line says that a resumed run or an evaluation must be given it again."""
        specs = [tool_spec(t) for t in self.tools]
        offers_tools = self.environment_factory is not None and not self.plays_episodes
        environment = tool_spec(self.environment_factory) if offers_tools else None
        path = Path(folder, TOOLS_FILE)
        path.write_text(json.dumps(
            {"tools": [s for s in specs if s], "environment": environment,
             "max_tool_calling_iterations": self.max_iterations}, indent=1) + "\n")
        lost = [(t, "tool") for t, s in zip(self.tools, specs) if s is None]
        if offers_tools and environment is None:
            lost.append((self.environment_factory, "environment"))
        lines = [f"warning: {what} {getattr(t, '__name__', t)!s} is not saved in {path}: `cohort-grpo chat` and `cohort "
                 f"eval` on this model will run without it; {unsaved_reason(t)}" for t, what in lost]
        if self.plays_episodes and not self.environment_from_task:
            lines.append(f"note: environment {type(self.environment_factory).__name__} plays episodes and is not saved "
                         f"in {path}: a run that resumes, and an evaluation, must be given it again (environment_factory=)")
        return lines


def make_toolbox(tools, environment_factory, args, task) -> Toolbox | None:
    """The run's Toolbox: `tools=` / `environment_factory=` given to the trainer, else the config's
    `tools` / `environment`, else the task's `tools`; None when nothing can be called."""
    tools = tools if tools is not None else args.tools
    if tools is None and task is not None:
        tools = getattr(task, "tools", None)
    if isinstance(tools, (list, tuple)) and all(isinstance(t, str) for t in tools):
        tools = ",".join(tools)  # the command line's list: each item may itself be "a:f,b:g"
    tools = resolve_tools(tools) if tools else []
    if environment_factory is None and args.environment:
        environment_factory = resolve_environment(args.environment)
    from_task = environment_factory is None and getattr(task, "environment_factory", None) is not None
    if from_task:  # a task whose environment speaks between turns
        environment_factory = task.environment_factory
    if not tools and environment_factory is None:
        if args.max_tool_calling_iterations is not None:
            raise CohortError(f"max_tool_calling_iterations={args.max_tool_calling_iterations} but the run has no "
                              "tools; pass --tools module:function or --environment module:Class")
        return None
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 1:
        raise CohortError(f"max_tool_calling_iterations={args.max_tool_calling_iterations}: it must be at least 1 "
                          "(or None for no limit)")
    return Toolbox(tools=tools, environment_factory=environment_factory,
                   max_iterations=args.max_tool_calling_iterations, timeout_s=args.tool_timeout,
                   template_kwargs=args.chat_template_kwargs, environment_from_task=from_task)


def read_tools_file(path: Path) -> dict:
    """tools.json as written by training, checked: {"tools": [str], "environment": str | None,
    "max_tool_calling_iterations": int | None}."""
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CohortError(f"{path} cannot be read as JSON ({' '.join(str(e).split())}); fix it or "
                          "delete it") from None
    tools = settings.get("tools", []) if isinstance(settings, dict) else None
    environment = settings.get("environment") if isinstance(settings, dict) else None
    iterations = settings.get("max_tool_calling_iterations") if isinstance(settings, dict) else None
    if (not isinstance(tools, list) or not all(isinstance(t, str) for t in tools)
            or not isinstance(environment, (str, type(None)))
            or not (iterations is None or (isinstance(iterations, int) and not isinstance(iterations, bool)))):
        raise CohortError(f"{path} is not {{\"tools\": [\"module:function\", ...], \"environment\": \"module:Class\" "
                          "or null, \"max_tool_calling_iterations\": N}; fix it or delete it")
    return {"tools": tools, "environment": environment, "max_tool_calling_iterations": iterations}


def saved_toolbox(folder, timeout_s: float | None = 30.0) -> Toolbox | None:
    """The Toolbox a training run recorded beside its model (tools.json), or None when there is none."""
    path = Path(folder, TOOLS_FILE) if folder else None
    if path is None or not path.is_file():
        return None
    saved = read_tools_file(path)
    environment = resolve_environment(saved["environment"]) if saved["environment"] else None
    tools = resolve_tools(saved["tools"])
    if not tools and environment is None:
        return None
    return Toolbox(tools=tools, environment_factory=environment,
                   max_iterations=saved["max_tool_calling_iterations"], timeout_s=timeout_s)
