"""The configs cohort refuses: the one table of them (`RULES`), and the one wording of a refused value.

Each `Rule` says when a config is refused (`refuses(config)`) and with what one-line message
(`message(config)`, written in the command line's words; cohort_grpo.errors shows it in a Python caller's).
Ranges, contradictions and unsupported combinations are all rows of the table; `GRPOConfig.check` walks it
after the types and the fixed values (cohort_grpo/config/choices.py) and raises the first refusal, and
docs/generate_reference.py prints each row's `when` in docs/reference.md. A stage that takes the same
values from Python walks the rows of its options (`REWARD_MODEL_RULES`, for `RewardModelSettings`), so
a value is refused in one place, with one wording.

A rule reads only the config: what depends on the number of processes or where they sample is decided
where that is known. The rows are read in order; a config that breaks several gets the first one's message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One kind of config refused: `when` in words (docs/reference.md), `refuses(config)` the same in code,
    `message(config)` the line that names the values and the fix."""
    when: str
    refuses: Callable[[object], bool]
    message: Callable[[object], str]


def refusal(name: str, value, problem: str, fix: str = "") -> str:
    """The one wording of a refused option value: `name=value problem; fix`, the value as Python writes it
    (`loss_type='ppo2'`, `beta=-0.5`). A problem that explains rather than states begins with a colon
    (`num_generations=1: GRPO needs ...`)."""
    text = f"{name}={value!r}" + (problem if problem.startswith(":") else f" {problem}")
    return text + (f"; {fix}" if fix else "")


def is_repo_id(text) -> bool:
    """A Hugging Face Hub repository id: `name` or `namespace/name`, each part letters, digits, '-', '_', '.',
    starting and ending with a letter or digit, without '--' or '..', 96 characters at most."""
    part = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
    return (isinstance(text, str) and len(text) <= 96 and re.fullmatch(f"(?:{part}/)?{part}", text) is not None
            and "--" not in text and ".." not in text)


def first_refusal(rules: Iterable[Rule], config) -> str | None:
    """The message of the first rule that refuses `config`, or None when none does."""
    return next((rule.message(config) for rule in rules if rule.refuses(config)), None)


def last_stage_start(config) -> int | None:
    """The training step where a curriculum's last stage starts (None without a curriculum, or where
    num_train_epochs sets max_steps later): a run that stops before it never trains that stage."""
    stages = config.curriculum
    if not stages or config.num_train_epochs is not None or not is_number(config.max_steps):
        return None
    return 1 + sum(int(stage["steps"]) for stage in stages[:-1])


def is_number(value) -> bool:
    """A count or a float given for an option; None, `auto` and the booleans are no numbers here."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def value_rule(name: str, ok: Callable[[float], bool], when: str, problem: str, fix: str = "") -> Rule:
    """Option `name` refused where it holds a number that is not `ok` (NaN is never ok)."""
    def refuses(config) -> bool:
        value = getattr(config, name)
        return is_number(value) and (math.isnan(value) or not ok(value))

    return Rule(when, refuses, lambda config: refusal(name, getattr(config, name), problem, fix))


def at_least(name: str, low: int, fix: str = "", unit: str = "") -> Rule:
    return value_rule(name, lambda v: v >= low, f"`{name}` < {low}",
                      f"must be at least {low}" + (f" {unit}" if unit else ""), fix)


def not_negative(name: str, fix: str = "", problem: str = "must be ≥ 0") -> Rule:
    return value_rule(name, lambda v: v >= 0, f"`{name}` < 0", problem, fix)


def positive(name: str, problem: str = "must be positive", fix: str = "") -> Rule:
    return value_rule(name, lambda v: v > 0, f"`{name}` ≤ 0", problem, fix)


def within(name: str, interval: str, why: str = "", fix: str = "") -> Rule:
    """`name` refused outside `interval`, written as the message shows it: `(0, 1]`, `[0, 1)`."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    above = (lambda v: v > low) if interval[0] == "(" else (lambda v: v >= low)
    below = (lambda v: v < high) if interval[-1] == ")" else (lambda v: v <= high)
    return value_rule(name, lambda v: above(v) and below(v), f"`{name}` outside {interval}",
                      f"must lie in {interval}" + (f": {why}" if why else ""), fix)


def step_count(name: str, zero_is_off: bool) -> Rule:
    """A count of steps given as transformers takes it: a whole number of steps (0 for off, where `zero_is_off`),
    or a fraction of max_steps in (0, 1); a number above 1 with a fractional part is neither."""
    def refuses(config) -> bool:
        value = getattr(config, name)
        return is_number(value) and (math.isnan(value) or value < 0 or (value == 0 and not zero_is_off)
                                     or (value > 1 and value != int(value)))

    fix = f"pass a whole number{' (0: off)' if zero_is_off else ''} or a fraction such as 0.1"
    return Rule(f"`{name}` {'negative' if zero_is_off else '≤ 0'}, or above 1 and not whole", refuses,
                lambda config: refusal(name, getattr(config, name), "is neither a whole number of steps nor a "
                                       "fraction of max_steps in (0, 1)", fix))


def epoch_strategy(config) -> str:
    """The name of the first strategy option set to epoch."""
    return "save_strategy" if config.save_strategy == "epoch" else "eval_strategy"


def ranks_per_engine(config) -> int:
    """The sampling ranks that share one engine where the config names a count, else 1 (`auto`, settled later)."""
    size = config.rollout_tensor_parallel_size
    return size if isinstance(size, int) else 1


def colocated_split(config) -> bool:
    """Engines split over several training ranks (no sampling ranks of their own)."""
    return ranks_per_engine(config) > 1 and not config.rollout_gpus


def recomputes_by_budget(config) -> bool:
    """gradient_checkpointing_layers is (or will be, by default) chosen under the memory budget."""
    return config.gradient_checkpointing_layers == "auto" or (
        config.gradient_checkpointing == "auto" and config.gradient_checkpointing_layers is None)


def clip_bounds_wrong(config) -> bool:
    low, high = config.importance_sampling_clip_min, config.importance_sampling_clip_max
    return (low is not None and low < 0) or (high is not None and high <= 0) or (
        low is not None and high is not None and low >= high)


def unused_teacher(coef) -> str:
    """The refusal of a teacher that a coefficient of 0 would load and never use."""
    return refusal("distillation_coef", coef, ": a teacher_model is given and would never be used",
                   "set --distillation_coef (1 with no reward functions is pure on-policy distillation) or drop the "
                   "teacher")


def bad_top_k(config) -> str:
    return ("sampling only the most likely token makes every group identical" if config.top_k == 1
            else "a negative count means nothing")


# The learned reward model's options: `GRPOConfig` checks them, and so does `RewardModelSettings` for a
# `RewardModelReward` built from Python, through these same rows.
REWARD_MODEL_RULES: tuple[Rule, ...] = (
    within("rm_replay_ratio", "[0, 1)"),
    within("rm_label_fraction", "(0, 1]"),
    at_least("rm_buffer_size", 1),
    at_least("rm_batch_size", 1),
    at_least("rm_max_length", 1),
    not_negative("rm_updates_per_step"),
    not_negative("rm_train_steps"),
    positive("rm_learning_rate"),
    not_negative("rm_warmup_batches"),
    not_negative("rm_warmup_updates"),
    positive("rm_head_learning_rate"),
)

RULES: tuple[Rule, ...] = (
    Rule("`data_files` and `dataset_name` both given",
         lambda c: c.data_files is not None and c.dataset_name is not None,
         lambda c: f"data_files={c.data_files!r} and dataset_name={c.dataset_name!r} both name the training rows; "
                   "pass only one"),
    value_rule("num_generations", lambda v: v >= 2, "`num_generations` < 2",
               ": GRPO needs at least 2 completions per prompt to form a group"),
    not_negative("router_aux_loss_coef", problem=": give a weight of 0 (off) or more"),
    Rule("`per_device_train_batch_size` × `gradient_accumulation_steps` not a multiple of `num_generations`",
         lambda c: c.generation_batch_size % c.num_generations != 0,
         lambda c: f"per_device_train_batch_size × gradient_accumulation_steps = {c.generation_batch_size} "
                   f"completions is not divisible by num_generations={c.num_generations}; make it a multiple"),
    Rule("`async_rollouts` with `max_staleness` < 1",
         lambda c: c.async_rollouts and c.max_staleness is not None and c.max_staleness < 1,
         lambda c: refusal("max_staleness", c.max_staleness, ": asynchronous rollouts are at least 1 update behind",
                           "give --max_staleness 1 or more, or leave --async_rollouts off")),
    Rule("`async_rollouts` with `importance_sampling_correction` false",
         lambda c: c.async_rollouts and c.importance_sampling_correction is False,
         lambda c: "async_rollouts trains on samples of an older policy, which only the sampler correction accounts "
                   "for; leave importance_sampling_correction on (or unset) with async_rollouts"),
    Rule("`async_rollouts` with a `curriculum`",
         lambda c: c.async_rollouts and bool(c.curriculum),
         lambda c: "async_rollouts with a curriculum is not supported (a rollout sampled ahead would cross a stage "
                   "switch); train the stages without --async_rollouts"),
    Rule("`partial_rollouts` true without `rollout_gpus`",
         lambda c: c.partial_rollouts is True and not c.rollout_gpus,
         lambda c: "partial_rollouts runs on sampling ranks: pass --async_rollouts true --rollout_gpus K under "
                   "torchrun, or leave partial_rollouts off"),
    Rule("`partial_rollouts` true with `max_staleness` < 2",
         lambda c: c.partial_rollouts is True and c.max_staleness is not None and c.max_staleness < 2,
         lambda c: f"partial_rollouts with max_staleness={c.max_staleness}: a group carried into the next call is "
                   "2 updates old when trained; give --max_staleness 2 or more"),
    not_negative("rollout_gpus", "give the number of sampling ranks, or 0", problem="is negative"),
    Rule("`rollout_gpus` without `async_rollouts`",
         lambda c: bool(c.rollout_gpus) and not c.async_rollouts,
         lambda c: refusal("rollout_gpus", c.rollout_gpus, "samples on other ranks, which is asynchronous by nature",
                           "pass --async_rollouts true (and --max_staleness) with it")),
    value_rule("rollout_tensor_parallel_size", lambda v: v >= 1, "`rollout_tensor_parallel_size` < 1",
               ": give the number of sampling ranks that share one engine (1: each sampling rank holds the whole "
               "model), or auto"),
    Rule("`rollout_tensor_parallel_size` does not divide `rollout_gpus`",
         lambda c: ranks_per_engine(c) > 1 and c.rollout_gpus % ranks_per_engine(c) != 0,
         lambda c: f"rollout_tensor_parallel_size={c.rollout_tensor_parallel_size} does not divide rollout_gpus="
                   f"{c.rollout_gpus}: the sampling ranks form groups of that many; give --rollout_gpus a multiple "
                   "of it"),
    Rule("`rollout_tensor_parallel_size` > 1 on the training ranks (no `rollout_gpus`) without `fsdp`",
         lambda c: colocated_split(c) and not c.fsdp,
         lambda c: f"rollout_tensor_parallel_size={ranks_per_engine(c)} without rollout_gpus samples on the training ranks "
                   "in groups, each rank keeping its shard of the model, which needs --fsdp (the update's weights "
                   "sharded too); pass --fsdp, or --rollout_gpus K to sample on ranks of their own"),
    Rule("`rollout_tensor_parallel_size` > 1 on the training ranks with `async_rollouts` and `max_staleness` "
         "other than 1",
         lambda c: colocated_split(c) and c.async_rollouts and c.max_staleness not in (None, 1),
         lambda c: f"async_rollouts with rollout_tensor_parallel_size={ranks_per_engine(c)} on the training ranks samples "
                   "on the shard the trainer refreshes after each update, 1 update behind; pass --max_staleness 1, "
                   "or --rollout_gpus K to sample further ahead on ranks of their own"),
    value_rule("max_concurrent_sequences", lambda v: v >= 1, "`max_concurrent_sequences` < 1",
               ": give the most sequences an engine decodes at once (1 or more), or auto"),
    Rule("`rollout_gpus` with `fsdp`",
         lambda c: bool(c.rollout_gpus) and c.fsdp,
         lambda c: f"rollout_gpus={c.rollout_gpus} with fsdp is not supported (the samplers need whole weights "
                   "from one rank); train the trainer ranks with DDP (leave out --fsdp)"),
    Rule("`importance_sampling_clip_min` < 0, `importance_sampling_clip_max` ≤ 0, or min ≥ max",
         clip_bounds_wrong,
         lambda c: f"importance_sampling_clip_min={c.importance_sampling_clip_min} / clip_max="
                   f"{c.importance_sampling_clip_max}: the bounds must satisfy 0 ≤ min < max"),
    Rule("a truncate `importance_sampling_mode` with neither clip bound",
         lambda c: c.importance_sampling_clip_max is None and c.importance_sampling_clip_min is None
         and c.importance_sampling_mode.endswith("truncate"),
         lambda c: "importance_sampling_clip_max=None with a truncate mode and no clip_min truncates nothing; give "
                   "a bound, or use a mask mode"),
    value_rule("delta", lambda v: v > 1, "`delta` ≤ 1",
               "caps the importance ratio below 1, where every on-policy token sits",
               "choose a value above 1 + epsilon_high, e.g. 4"),
    Rule("`rollout_numerics` exact with `use_peft`",
         lambda c: c.rollout_numerics == "exact" and c.use_peft,
         lambda c: "rollout_numerics=exact does not cover LoRA adapters yet; use --rollout_numerics fast with "
                   "use_peft"),
    Rule("`rollout_numerics` exact with `rollout_tensor_parallel_size` > 1",
         lambda c: c.rollout_numerics == "exact" and ranks_per_engine(c) > 1,
         lambda c: f"rollout_numerics=exact covers one engine per GPU, not rollout_tensor_parallel_size="
                   f"{ranks_per_engine(c)}; give --rollout_tensor_parallel_size 1 or --rollout_numerics fast"),
    Rule("`rollout_numerics` exact with `model_impl` hf",
         lambda c: c.rollout_numerics == "exact" and c.model_impl == "hf",
         lambda c: "rollout_numerics=exact needs cohort's own models; leave out --model_impl hf or use "
                   "--rollout_numerics fast"),
    Rule("`torch_compile` true with `model_impl` hf",
         lambda c: c.torch_compile is True and c.model_impl == "hf",
         lambda c: "torch_compile=true compiles the decoder layers of cohort's own models, not transformers' "
                   "(model_impl hf): use --torch_compile auto, or leave out --model_impl hf"),
    Rule("`use_peft` with `lora_r` < 1",
         lambda c: c.use_peft and c.lora_r < 1,
         lambda c: refusal("lora_r", c.lora_r, ": the LoRA rank must be at least 1")),
    not_negative("max_tokens_per_micro_batch", "use 0 (no token cap) or a token budget such as 16384",
                 problem="is negative"),
    Rule("`max_memory_gib` < 0, or > 0 without `gradient_checkpointing_layers` auto",
         lambda c: c.max_memory_gib < 0 or bool(c.max_memory_gib and not recomputes_by_budget(c)),
         lambda c: refusal("max_memory_gib", c.max_memory_gib, "is only the budget of gradient_checkpointing_layers="
                           "auto and must be ≥ 0", "pass --gradient_checkpointing_layers auto with it, or leave it "
                           "at 0")),
    at_least("cpu_threads", 1, "pass a count of threads, or auto"),
    not_negative("gradient_checkpointing_layers", "use 0 (no layer recomputed) up to the model's layer count, or "
                 "leave it unset to recompute every layer", problem="is negative"),
    Rule("`gradient_checkpointing_layers` with `gradient_checkpointing` false",
         lambda c: c.gradient_checkpointing_layers is not None and c.gradient_checkpointing is False,
         lambda c: refusal("gradient_checkpointing_layers", c.gradient_checkpointing_layers,
                           "does nothing without gradient_checkpointing", "pass --gradient_checkpointing true as "
                           "well")),
    Rule("`offload_optimizer` true with `fsdp`, `use_peft` or float32 weights",
         lambda c: c.offload_optimizer is True and (c.fsdp or c.use_peft or c.dtype in ("float32", "float16")),
         lambda c: refusal("offload_optimizer", True, "keeps the fp32 masters' low halves and the moments of bf16 "
                           "weights in host memory, for a process that holds the whole model: "
                           + ("FSDP2 shards that state over the GPUs already" if c.fsdp else
                              "LoRA's adapters train in float32 and their state is small" if c.use_peft else
                              f"dtype={c.dtype} has no split masters"),
                           "leave offload_optimizer auto" + ("" if c.fsdp or c.use_peft else ", or pass --dtype bfloat16"))),
    not_negative("beta", "the KL coefficient must be ≥ 0", problem="is negative"),
    not_negative("distillation_coef", "0 is off; 1 with no reward functions is pure on-policy distillation",
                 problem="is negative"),
    within("distillation_discount", "[0, 1]"),
    Rule("`teacher_model` with `distillation_coef` 0",
         lambda c: c.teacher_model is not None and not c.distillation_coef,
         lambda c: unused_teacher(c.distillation_coef)),
    within("epsilon", "(0, 1)"),
    Rule("`epsilon_high` < `epsilon`",
         lambda c: c.epsilon_high is not None and c.epsilon_high < c.epsilon,
         lambda c: refusal("epsilon_high", c.epsilon_high, f"is below epsilon={c.epsilon}",
                           "clip-higher needs epsilon_high ≥ epsilon")),
    positive("num_train_epochs", "must be positive, or None to count max_steps"),
    *(at_least(name, 1) for name in ("num_iterations", "max_steps", "max_completion_length",
                                     "per_device_train_batch_size", "gradient_accumulation_steps",
                                     "max_prompt_length")),
    *(not_negative(name) for name in ("ref_reset_steps", "eval_limit", "save_total_limit")),
    *(step_count(name, off) for name, off in (("logging_steps", False), ("log_completions_steps", False),
                                              ("save_steps", True), ("eval_steps", True), ("warmup_steps", True))),
    within("warmup_ratio", "[0, 1]"),
    Rule("`save_strategy` or `eval_strategy` epoch with a `curriculum`",
         lambda c: bool(c.curriculum) and "epoch" in (c.save_strategy, c.eval_strategy),
         lambda c: f"{epoch_strategy(c)}='epoch' with a curriculum: each stage counts its own steps and rows; give "
                   f"{epoch_strategy(c).replace('strategy', 'steps')} instead"),
    Rule("a `curriculum` stage that `max_steps` never reaches",
         lambda c: last_stage_start(c) is not None and c.max_steps < last_stage_start(c),
         lambda c: refusal("max_steps", c.max_steps, f"ends before curriculum stage {len(c.curriculum)} "
                           f"({c.curriculum[-1]['task']}) starts at step {last_stage_start(c)}",
                           f"give --max_steps {last_stage_start(c)} or more, or shorten the stages before it")),
    at_least("max_consecutive_nonfinite", 1),
    Rule("`hub_model_id` not a Hub repository id",
         lambda c: c.hub_model_id is not None and not is_repo_id(c.hub_model_id),
         lambda c: refusal("hub_model_id", c.hub_model_id, "is not a Hub repository id",
                           "give name or namespace/name (letters, digits, '-', '_', '.')")),
    Rule("`overwrite_output_dir` with `resume` or `resume_from_checkpoint`",
         lambda c: c.overwrite_output_dir and bool(c.resume or c.resume_from_checkpoint),
         lambda c: "overwrite_output_dir and resume contradict each other: resume continues the earlier run, "
                   "overwrite_output_dir deletes it; pass only one"),
    at_least("ddp_timeout", 1, unit="second"),
    # Greedy sampling makes the G completions of a prompt identical: every advantage is 0, nothing is learnt.
    positive("temperature", ": GRPO needs the completions of one prompt to differ, and greedy sampling makes "
             "every group identical", "pass --temperature > 0, e.g. 0.7-1.0"),
    Rule("`top_k` 1 or negative",
         lambda c: c.top_k == 1 or c.top_k < 0,
         lambda c: refusal("top_k", c.top_k, f": {bad_top_k(c)}", "pass --top_k 0 (off) or more than 1")),
    within("min_p", "[0, 1)", "at 1 only the most likely token is sampled and every group is identical",
           "pass --min_p 0 (off) or e.g. 0.05"),
    within("top_p", "(0, 1]"),
    positive("learning_rate"),
    not_negative("max_resample_tries"),
    Rule("`overlong_buffer_length` outside [0, `max_completion_length`]",
         lambda c: not 0 <= c.overlong_buffer_length <= c.max_completion_length,
         lambda c: refusal("overlong_buffer_length", c.overlong_buffer_length,
                           f"must lie in [0, max_completion_length={c.max_completion_length}]")),
    *REWARD_MODEL_RULES,
    Rule("`reward_weights` and `reward_funcs` of different lengths",
         lambda c: c.reward_weights is not None and c.reward_funcs is not None
         and len(c.reward_weights) != len(c.reward_funcs),
         lambda c: f"{len(c.reward_weights)} reward_weights for {len(c.reward_funcs)} reward_funcs; give one "
                   "weight per function"),
)
