"""Reward functions (`rules`), the grader of math answers (`grading`, its steps in `answer_extraction`,
`answer_reading` and `answer_comparison`), and the runner that calls them safely and combines them (`runner`).

`RewardRunner` / `RewardOutput` are imported lazily: they need torch, and the per-sample scoring
worker processes import this package without wanting torch.
"""

from cohort_grpo.rewards.rules import (
    REWARD_FUNCS,
    accuracy_reward,
    canonical_answer,
    completion_text,
    extract_answer,
    format_reward,
    get_soft_overlong_punishment,
    lenient_format_reward,
    reasoning_steps_reward,
    resolve_reward,
    tag_count_reward,
    think_format_reward,
)

__all__ = [
    "REWARD_FUNCS", "RewardModelReward", "RewardOutput", "RewardRunner", "accuracy_reward",
    "canonical_answer",
    "completion_text", "extract_answer", "format_reward", "get_soft_overlong_punishment", "lenient_format_reward",
    "reasoning_steps_reward", "resolve_reward", "tag_count_reward", "task_labeller", "think_format_reward",
]


def __getattr__(name):
    if name in ("RewardRunner", "RewardOutput"):
        from cohort_grpo.rewards import runner

        return getattr(runner, name)
    if name in ("RewardModelReward", "task_labeller"):  # the learned reward model r_φ, trained with replay
        from cohort_grpo.rewards import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
