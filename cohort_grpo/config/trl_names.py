"""TRL 1.16's `GRPOConfig` keywords that are not cohort fields, so a TRL script ports by its import alone.

TRL's `GRPOConfig` is a transformers `TrainingArguments`, so a script may pass any of its fields as well.
`translate` turns such keywords into cohort's before the dataclass sees them:

- a name with a cohort meaning becomes cohort's setting (`bf16=True` → `dtype="bfloat16"`,
  `log_completions=True` → completions logged every `logging_steps`);
- a value that asks for what cohort does anyway is dropped (`use_vllm=False`, `shuffle_dataset=True`);
- any other value is a one-line `CohortError` naming cohort's equivalent or why it does not apply
  (`use_vllm=True`: cohort samples with its own engine).

A transformers field with no entry here is accepted at its transformers default and refused otherwise.
`num_train_epochs`, `chat_template_kwargs`, `warmup_ratio`, `save_strategy` and `eval_strategy` are cohort fields
of TRL's name and meaning, not entries here.
"""

from __future__ import annotations

import dataclasses
import difflib

from cohort_grpo.errors import CohortError

# Any value: the setting only acts with a feature TRL itself leaves off unless asked (vLLM, the sapo or vespo
# loss, adaptive entropy, a reference-model sync), or it only shapes console output; cohort leaves it unused.
ANY = "any value"

NO_VLLM = "cohort samples with its own engine from the trained weights, not vLLM (docs/howto/speed.md)"

# TRL name → (values that ask for what cohort always does, why another value cannot be honoured).
FIXED: dict[str, tuple] = {
    "use_vllm": ((False,), NO_VLLM + "; remove use_vllm"),
    "model_init_kwargs": ((None, {}), "cohort loads the model with dtype, trust_remote_code and model_impl; pass "
                          "those, or load the model yourself and pass the object"),
    "router_aux_loss_coef": ((None,), "cohort has no mixture-of-experts load-balancing loss"),
    "cast_lm_head_to_fp32": ((False,), "the LM head runs in dtype; log-softmax and entropy are float32 already"),
    "remove_unused_columns": ((False,), "every column reaches the reward functions"),
    "num_generations_eval": ((None,), "evaluation samples num_generations completions per prompt (TRL's default; "
                             "a built-in task's is greedy, one per problem: cohort-grpo eval --num_samples gives pass@k)"),
    "ds3_gather_for_generation": (ANY, "no DeepSpeed"),
    "shuffle_dataset": ((True,), "the prompts are always shuffled from seed"),
    "pad_to_multiple_of": (("auto", None), "a Neuron (Trainium) option; cohort runs on CUDA GPUs and CPUs"),
    # these two also take the value of TRL's default written out (`batch_shape`): what cohort does
    "generation_batch_size": ((None,), "a step's completions are per_device_train_batch_size × "
                              "gradient_accumulation_steps; set those"),
    "steps_per_generation": ((None,), "cohort takes one optimizer step per rollout; set gradient_accumulation_steps "
                             "for the micro-batches of that step"),
    "generation_kwargs": ((None, {}), "sampling takes temperature, top_p, top_k and min_p"),
    "repetition_penalty": ((1.0,), "cohort's sampler has no repetition penalty"),
    "cache_implementation": ((None,), "cohort's engine manages its own KV cache"),
    "vllm_mode": (ANY, NO_VLLM), "vllm_model_impl": (ANY, NO_VLLM), "vllm_enable_sleep_mode": (ANY, NO_VLLM),
    "vllm_structured_outputs_regex": (ANY, NO_VLLM), "vllm_server_base_url": (ANY, NO_VLLM),
    "vllm_server_host": (ANY, NO_VLLM), "vllm_server_port": (ANY, NO_VLLM), "vllm_server_timeout": (ANY, NO_VLLM),
    "vllm_group_port": (ANY, NO_VLLM), "vllm_gpu_memory_utilization": (ANY, NO_VLLM),
    "vllm_max_model_length": (ANY, NO_VLLM), "vllm_tensor_parallel_size": (ANY, NO_VLLM),
    "sapo_temperature_neg": (ANY, "no sapo loss"), "sapo_temperature_pos": (ANY, "no sapo loss"),
    "vespo_k_pos": (ANY, "no vespo loss"), "vespo_lambda_pos": (ANY, "no vespo loss"),
    "vespo_k_neg": (ANY, "no vespo loss"), "vespo_lambda_neg": (ANY, "no vespo loss"),
    "multi_objective_aggregation": (("sum_then_normalize",), "rewards are always summed, then normalised"),
    "sync_ref_model": ((False,), "cohort resets π_ref to π_θ every ref_reset_steps steps (TRL's sync at "
                       "ref_model_mixup_alpha=1); pass ref_reset_steps=ref_model_sync_steps"),
    "ref_model_mixup_alpha": (ANY, "used only with sync_ref_model"),
    "ref_model_sync_steps": (ANY, "used only with sync_ref_model"),
    "top_entropy_quantile": ((1.0,), "every completion token trains"),
    "use_adaptive_entropy": ((False,), "the entropy bonus has a fixed coefficient; set entropy_coef"),
    "entropy_coef_min": (ANY, "adaptive entropy"), "entropy_coef_max": (ANY, "adaptive entropy"),
    "entropy_coef_delta": (ANY, "adaptive entropy"), "entropy_target": (ANY, "adaptive entropy"),
    "off_policy_mask_threshold": ((None,), "cohort has no off-policy sequence masking"),
    "log_multimodal": (ANY, "images are not logged (completions.jsonl holds the text)"),
    "num_completions_to_print": (ANY, "cohort prints no completions; completions.jsonl holds them"),
    "log_unique_prompts": (ANY, "completions.jsonl holds every logged prompt"),
    "log_completions_hub_repo": ((None,), "cohort uploads nothing to the Hub; completions.jsonl is in output_dir"),
    "use_transformers_continuous_batching": ((False,), "cohort's engine batches its own models"),
    "transformers_continuous_batching_config": (ANY, "used only with use_transformers_continuous_batching"),
    "use_transformers_paged": ((False,), "cohort's engine batches its own models"),
    # transformers' TrainingArguments fields a GRPO script often sets.
    "optim": (("adamw_torch", "adamw_torch_fused", "adamw_hf"), "cohort's optimizer is AdamW (with fp32 master "
              "weights for bf16 weights); set adam_beta1, adam_beta2 and weight_decay"),
    "lr_scheduler_kwargs": ((None, {}), "lr_scheduler_type takes constant, cosine or linear without options"),
    "gradient_checkpointing_kwargs": (ANY, "cohort checkpoints its own way (gradient_checkpointing_layers)"),
    "per_device_eval_batch_size": (ANY, "evaluation batches itself"),
    "do_train": (ANY, "only shapes transformers' example scripts"),
    "do_eval": (ANY, "only shapes transformers' example scripts"),
    "logging_first_step": (ANY, "cohort logs step 1 always"),
    "logging_dir": (ANY, "TensorBoard logs go to output_dir/tensorboard"),
    "run_name": (ANY, "cohort names the run after output_dir"),
}


# TRL's GRPOTrainer keywords that cohort's trainer cannot honour unless left at TRL's default: why, and the fix.
TRAINER_KEYWORDS = {
    "optimizers": ((None, None), "cohort builds its own AdamW and schedule; set learning_rate, adam_beta1, "
                   "adam_beta2, weight_decay and lr_scheduler_type in GRPOConfig"),
    "quantization_config": (None, "cohort trains unquantised weights; load the model in dtype (GRPOConfig(dtype=...))"),
    "rollout_func": (None, "cohort samples with its own engine; pass tools= or environment_factory= for multi-turn "
                     "rollouts"),
}


def check_trainer_keywords(**given) -> None:
    """A one-line `CohortError` for a TRL GRPOTrainer keyword (`TRAINER_KEYWORDS`) set to other than its default."""
    for name, value in given.items():
        default, why = TRAINER_KEYWORDS[name]
        if not (value is None or (isinstance(value, tuple) and value == default)):
            raise CohortError(f"cohort cannot honour GRPOTrainer({name}=...): {why}")


def translate(kwargs: dict, defaults: dict) -> dict:
    """`kwargs` as cohort's dataclass takes them (`defaults`: each cohort field's default): TRL's names
    turned into cohort's settings or dropped, anything cohort cannot honour a one-line `CohortError`."""
    out = {name: value for name, value in kwargs.items() if name in defaults}
    given = set(out)
    for name, value in kwargs.items():
        if name in defaults:
            continue
        if name in ("bf16", "fp16"):
            precision(out, kwargs, given)
        elif name == "log_completions":
            if value and "log_completions_steps" not in given:  # TRL logs completions every logging_steps steps
                out["log_completions_steps"] = out.get("logging_steps", defaults["logging_steps"])
        elif name == "use_cpu":
            if value:
                setting(out, given, "device", "cpu", f"use_cpu={value!r}")
        elif name == "disable_tqdm":
            if value:
                setting(out, given, "quiet", True, f"disable_tqdm={value!r}")
        elif name in BATCH_SHAPE and value == batch_shape(name, out, defaults):
            continue  # TRL's default written out: one rollout per optimizer step, as cohort samples
        elif name in FIXED:
            accepted, why = FIXED[name]
            if accepted is not ANY and not any(value == v and type(value) is type(v) or value is v for v in accepted):
                raise CohortError(f"cohort cannot honour GRPOConfig({name}={value!r}): {why}")
        else:
            refuse_unknown(name, value, defaults)
    if out.get("min_p", 0.0) is None:  # TRL's spelling of off
        out["min_p"] = 0.0
    if "top_k" in out and out["top_k"] is None:  # off in TRL too (its generate's and vLLM's)
        out["top_k"] = 0
    if out.get("max_steps") == -1:  # transformers' "train for num_train_epochs" (3 unless given)
        del out["max_steps"]
        if out.get("num_train_epochs") is None:
            out["num_train_epochs"] = transformers_defaults().get("num_train_epochs", 3.0)
    return out


BATCH_SHAPE = ("steps_per_generation", "generation_batch_size")


def batch_shape(name: str, out: dict, defaults: dict) -> int:
    """What TRL's steps_per_generation or generation_batch_size is when it samples as cohort does, one rollout per
    optimizer step: gradient_accumulation_steps, or per_device_train_batch_size × that (one process)."""
    steps = out.get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"])
    if name == "steps_per_generation":
        return steps
    return out.get("per_device_train_batch_size", defaults["per_device_train_batch_size"]) * steps


def precision(out: dict, kwargs: dict, given: set) -> None:
    """TRL's bf16 / fp16 (mixed precision) as cohort's dtype: bf16 weights with fp32 masters, fp16 likewise,
    or float32 when both are off."""
    bf16, fp16 = bool(kwargs.get("bf16")), bool(kwargs.get("fp16"))
    if bf16 and fp16:
        raise CohortError("GRPOConfig(bf16=True, fp16=True) asks for two precisions; pass one (cohort: dtype)")
    dtype = "bfloat16" if bf16 else "float16" if fp16 else "float32"
    setting(out, given, "dtype", dtype, ", ".join(f"{k}={kwargs[k]!r}" for k in ("bf16", "fp16") if k in kwargs))


def setting(out: dict, given: set, name: str, value, asked: str) -> None:
    if name in given and out[name] != value:
        raise CohortError(f"GRPOConfig({asked}) means {name}={value!r}, but {name}={out[name]!r} is given too; "
                          f"pass only one")
    out[name] = value


def refuse_unknown(name: str, value, defaults: dict) -> None:
    """A transformers TrainingArguments field at its default is what cohort does; any other name is an error."""
    training_arguments = transformers_defaults()
    if name in training_arguments:
        if value == training_arguments[name]:
            return
        raise CohortError(f"GRPOConfig({name}={value!r}) is a transformers TrainingArguments option that cohort's "
                          "trainer does not use; remove it (docs/howto/from-trl.md lists what carries over)")
    close = difflib.get_close_matches(name, [*defaults, *FIXED, "bf16", "fp16", "log_completions"], n=1)
    hint = f"; did you mean {close[0]}?" if close else "; docs/reference.md lists the options"
    raise CohortError(f"GRPOConfig got an unknown option {name!r}{hint}")


def transformers_defaults() -> dict:
    """Each transformers TrainingArguments field's default (empty without transformers)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return {}
    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out
