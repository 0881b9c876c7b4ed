"""Built-in tasks, looked up by name (`--task`)."""

from __future__ import annotations

import importlib

from cohort_grpo.config.choices import TASKS, task_path

__all__ = ["TASKS", "get_task", "task_class", "prompt_text"]


def task_class(name: str):
    """The class of task `name` or of a family of tasks (`reasoning_gym:leg_counting` and `reasoning_gym` alike:
    the reasoning_gym family's), not built."""
    module, attr = (TASKS[name] if name in TASKS else task_path(name)[0]).split(":")
    return getattr(importlib.import_module(module), attr)


def get_task(name: str):
    """Task `name` built: `arithmetic`, or a family's with its argument (`reasoning_gym:leg_counting`)."""
    argument = task_path(name)[1]
    return task_class(name)() if argument is None else task_class(name)(argument)


def prompt_text(tokenizer, prompt, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """The text a model sees for a prompt: a string as is; chat messages through the tokenizer's chat
    template (with the assistant turn opened, the `tools` schemas where the template shows them, and
    `template_kwargs`, the run's chat_template_kwargs), or, for a tokenizer without one, the message
    contents one per line. Training, evaluation and SFT all encode prompts with this, so they see the
    same text."""
    if not isinstance(prompt, list):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    return "\n".join(m["content"] for m in prompt) + "\n"
