"""Environments (TRL's `environment_factory`): one object per completion whose public methods are its
tools. `reset(**row)` starts it on the completion's dataset row (a returned string is appended to the
prompt's last user message); an optional `get_reward()` scores the rollout from the environment's state,
as one more reward function (weight 1, named after the class), summed with the others.
"""

from __future__ import annotations

import inspect

from cohort_grpo.errors import CohortError
def reset_environments(factory, rows: list[dict]) -> tuple[list, list[str | None]]:
    """One environment per row, each `reset(**row)` (TRL: the returned string, if any, is appended to the
    prompt's last user message; None keeps the prompt as it is)."""
    environments, additions = [], []
    for row in rows:
        env = factory()
        reset = getattr(env, "reset", None)
        if not callable(reset):
            raise CohortError(f"environment {type(env).__name__} has no reset() method; define reset(self, **row)")
        parameters = inspect.signature(reset).parameters.values()
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        names = {p.name for p in parameters}
        added = reset(**(row if takes_any else {k: v for k, v in row.items() if k in names}))
        if added is not None and not isinstance(added, str):
            raise CohortError(f"{type(env).__name__}.reset returned a {type(added).__name__}; return a string "
                              "(appended to the prompt) or None")
        environments.append(env)
        additions.append(added)
    return environments, additions


def with_addition(prompt, addition: str | None):
    """The prompt with an environment's reset text appended (to the last user message of a chat)."""
    if not addition:
        return prompt
    if isinstance(prompt, str):
        return prompt + addition
    messages = [dict(m) for m in prompt]
    for message in reversed(messages):
        if message.get("role") == "user":
            message["content"] = f"{message['content']}{addition}"
            break
    return messages


def environment_reward(factory):
    """The reward function an environment class with `get_reward()` adds (None without one): each
    completion's score is its own environment's `get_reward()`, passed in as `environments`."""
    if factory is None:
        return None
    probe = factory()
    if not callable(getattr(probe, "get_reward", None)):
        return None
    kind = type(probe)

    def reward(prompts=None, completions=None, environments=None, **_):
        if environments is None:
            raise CohortError(f"{kind.__name__}.get_reward needs the rollout's environments; none were passed")
        return [env.get_reward() if type(env) is kind else None for env in environments]

    reward.__name__ = kind.__name__
    return reward
