"""The values an option takes, where they are a fixed set: the one table of them.

`GRPOConfig.validate` refuses a value outside it, `cohort-grpo train --help` shows it (`cohort_grpo.config.command_line.type_text`),
docs/generate_reference.py prints it in docs/reference.md, and the stages that take such a value from
Python directly (the loss, the reward model's buffer, loss and scorer, the reward runner, the reporters)
check it against the same entry. A value added here is accepted, shown and documented at once.

Besides literal values an entry may hold a pattern: `N` is a whole number, `cuda:N` a GPU's index, and
`true` / `false` match Python's booleans as well as the words.
"""

from __future__ import annotations

import re

from cohort_grpo.config.rules import refusal
from cohort_grpo.errors import CohortError

# The built-in tasks (`--task`): name → "module:attribute", imported only when asked for (`cohort_grpo.tasks.get_task`).
TASKS = {
    "arithmetic": "cohort_grpo.tasks.arithmetic:ArithmeticTask",
    "calculator": "cohort_grpo.tasks.calculator:CalculatorTask",  # tool use: the tiny tools model and a calculator
    "gsm8k": "cohort_grpo.tasks.gsm8k:GSM8KTask",
    "generic": "cohort_grpo.tasks.generic:GenericTask",  # your rows and reward functions, no verifier
    "shapes": "cohort_grpo.tasks.shapes:ShapesTask",  # vision: count one colour's shapes in a drawn image
    # reasoning-gym's generators (the envs extra), named with an argument: reasoning_gym:NAME[:WEIGHT],...
    "reasoning_gym": "cohort_grpo.tasks.reasoning_gym:ReasoningGymTask",
    # an installed verifiers environment (the verifiers extra): verifiers:ENV_ID[:key=value,...]
    "verifiers": "cohort_grpo.tasks.verifiers:VerifiersTask",
}
# The tasks named `family:argument` (`reasoning_gym:leg_counting`): the class is built with the argument.
TASK_FAMILIES = ("reasoning_gym", "verifiers")

# The options whose values `choose` splits at commas: each item must be a value of the option.
LISTS = ("report_to",)

CHOICES: dict[str, tuple[str, ...]] = {
    "task": tuple(name for name in TASKS if name not in TASK_FAMILIES) + tuple(f"{f}:NAME" for f in TASK_FAMILIES),
    "loss_type": ("grpo", "bnpo", "dapo", "dr_grpo"),
    "scale_rewards": ("group", "batch", "none"),
    "importance_sampling_level": ("token", "sequence"),
    "importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "lr_scheduler_type": ("constant", "cosine", "linear"),
    "rm_buffer_policy": ("fifo", "reservoir"),
    "rm_loss": ("pointwise", "pairwise"),
    "rm_scorer": ("head", "likelihood"),
    "reward_errors": ("raise", "warn"),
    "long_prompts": ("refuse", "truncate_left"),
    "device": ("auto", "cpu", "cuda", "cuda:N"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "optimizer_state_dtype": ("auto", "float32", "bfloat16"),
    "offload_optimizer": ("auto", "true", "false"),
    "model_impl": ("auto", "cohort", "hf"),
    "report_to": ("none", "tensorboard", "wandb", "all"),
    "save_strategy": ("steps", "epoch", "no"),
    "eval_strategy": ("steps", "epoch", "no"),
    "gradient_checkpointing": ("auto", "true", "false"),
    "gradient_checkpointing_layers": ("N", "auto"),
    "max_tokens_per_micro_batch": ("N", "auto"),
    "torch_compile": ("auto", "true", "false"),
    "partial_rollouts": ("auto", "true", "false"),
    "rollout_tensor_parallel_size": ("auto", "N"),
    "max_concurrent_sequences": ("auto", "N"),
    "cpu_threads": ("auto", "N"),
    "rollout_numerics": ("fast", "exact"),
}

# Values TRL (or transformers) gives an option that cohort has no counterpart for: the refusal says what they are.
ELSEWHERE: dict[str, dict[str, str]] = {
    "loss_type": {name: f"is TRL's {name} loss, which cohort does not have" for name in ("cispo", "sapo", "luspo",
                                                                                      "vespo")},
    "save_strategy": {"best": "keeps the checkpoint of the best metric_for_best_model, which cohort does not track"},
}

# Options whose default, auto, is settled once the device and the model are known (cohort_grpo/run/resolve.py).
AUTO_OPTIONS = tuple(name for name, values in CHOICES.items() if "auto" in values)


def allowed(name: str, value) -> bool:
    """Whether `value` is one of option `name`'s values (any value, for an option not in the table)."""
    if name not in CHOICES:
        return True
    if name in LISTS and isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
        return bool(items) and all(allowed_one(name, item) for item in items)
    if name in LISTS and isinstance(value, (list, tuple)):  # an empty list is transformers' none
        return all(allowed_one(name, item) for item in value)
    return allowed_one(name, value)


def allowed_one(name: str, value) -> bool:
    values = CHOICES[name]
    if isinstance(value, bool):
        return ("true" if value else "false") in values
    if isinstance(value, int):
        return "N" in values
    if not isinstance(value, str):
        return False
    if value in values:
        return True
    family, colon, argument = value.partition(":")
    if colon and argument.strip() and f"{family}:NAME" in values:
        return True
    return "cuda:N" in values and re.fullmatch(r"cuda:\d+", value) is not None


def choose(name: str, value) -> None:
    """Refuse a value outside option `name`'s entry with one line naming the option and its values (and, for a
    list, the item that is not one of them)."""
    if allowed(name, value):
        return
    problem = ELSEWHERE.get(name, {}).get(value, "is not one of its values") if isinstance(value, str) else (
        "is not one of its values")
    fix = f"pass {values_text(name)} (--{name})"
    if name in LISTS:
        items = [item.strip() for item in value.split(",")] if isinstance(value, str) else value
        items = items if isinstance(items, (list, tuple)) else [items]
        wrong = [item for item in items if not allowed_one(name, item)]
        if len(items) > 1 and wrong:
            problem = f": {wrong[0]!r} is not one of its values"
        fix = f"pass {values_text(name)}, or several of them as a list or comma-separated (--{name})"
    raise CohortError(refusal(name, value, problem, fix))


def task_path(name: str) -> tuple[str, str | None]:
    """The "module:attribute" of a task's class and the argument it is built with (None for a plain task);
    an unknown task is a one-line `CohortError` naming the choices."""
    family, colon, argument = str(name).partition(":")
    if family in TASK_FAMILIES and colon:
        return TASKS[family], argument
    if name not in TASKS or name in TASK_FAMILIES:
        raise CohortError(f"unknown task {name!r}; choose one of {values_text('task')} (--task)")
    return TASKS[name], None


def values_text(name: str) -> str:
    """`a, b or c`: option `name`'s values as a sentence writes them."""
    values = ["a whole number" if value == "N" else value for value in CHOICES[name]]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]
