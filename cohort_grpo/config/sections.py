"""The sections of `cohort-grpo train --help` and docs/reference.md: each a title, what it covers, and its options.

`GRPOConfig`'s fields stand in the class in the same order and blocks, so the class reads as the help does;
tests/test_reference_doc.py checks that the sections hold every field once, in the class's order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    title: str
    description: str  # shown under the title in docs/reference.md; empty when the title says it all
    options: tuple[str, ...]


SECTIONS: tuple[Section, ...] = (
    Section("What to train, on what",
            "",
            ("model", "task", "data_files", "dataset_name", "dataset_config", "dataset_train_split",
             "dataset_test_split", "prompt_column", "eval_data_files", "subset", "levels", "output_dir")),
    Section("Algorithm 1",
            "",
            ("num_generations", "num_iterations", "ref_reset_steps", "max_steps", "num_train_epochs", "epsilon",
             "epsilon_high", "beta", "loss_type", "scale_rewards", "reward_funcs", "reward_weights",
             "reward_timeout")),
    Section("Reward faults",
            "Reward faults: a reward function that raises stops the run, unless told to score None "
            "(cohort_grpo/rewards/runner.py).",
            ("reward_errors",)),
    Section("Tools",
            "Tools: multi-turn rollouts in which the model calls functions (cohort_grpo/tools/, "
            "docs/howto/tools.md).",
            ("tools", "environment", "max_tool_calling_iterations", "tool_timeout")),
    Section("Asynchronous rollouts",
            "Asynchronous rollouts (cohort_grpo/rollout/async_rollouts.py): sampling of later steps overlaps the "
            "update.",
            ("async_rollouts", "rollout_gpus", "rollout_tensor_parallel_size", "max_concurrent_sequences",
             "max_staleness", "partial_rollouts")),
    Section("Algorithm breadth",
            "Algorithm breadth: DAPO, GSPO, an entropy bonus. The defaults leave plain GRPO unchanged.",
            ("dynamic_sampling", "max_resample_tries", "overlong_buffer_length", "overlong_penalty_factor",
             "mask_truncated_completions", "importance_sampling_level", "entropy_coef", "delta",
             "use_bias_correction_kl")),
    Section("On-policy distillation",
            "On-policy distillation: a frozen teacher scores every token the policy samples, and its per-token "
            "log-probs join the advantages (cohort_grpo/update/teacher.py, docs/howto/distillation.md).",
            ("teacher_model", "teacher_model_init_kwargs", "distillation_coef", "distillation_discount",
             "teacher_model_name_or_path")),
    Section("The sampler computes in other kernels than the trainer",
            "The sampler computes in other kernels than the trainer (bf16 on a GPU): its samples' "
            "probabilities under the trainer differ. Measured every step (sampling/*); corrected by "
            "importance weights.",
            ("importance_sampling_correction", "importance_sampling_mode", "importance_sampling_clip_min",
             "importance_sampling_clip_max", "vllm_importance_sampling_correction",
             "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
             "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap", "rollout_numerics")),
    Section("Learned reward model r_φ",
            "Learned reward model r_φ: a reward_funcs entry that is a model folder or object, trained online "
            "on rule-labelled samples with replay (Algorithm 1, last line). See cohort_grpo/rewards/model.py.",
            ("rm_updates_per_step", "rm_buffer_size", "rm_buffer_policy", "rm_replay_ratio", "rm_batch_size",
             "rm_learning_rate", "rm_loss", "rm_label_fraction", "rm_train_steps", "rm_max_length", "rm_scorer",
             "rm_head_learning_rate", "rm_warmup_batches", "rm_warmup_updates")),
    Section("Sampling",
            "",
            ("max_prompt_length", "long_prompts", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
             "chat_template_kwargs")),
    Section("Optimisation",
            "",
            ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "optimizer_state_dtype", "offload_optimizer",
             "max_grad_norm", "warmup_steps", "warmup_ratio", "lr_scheduler_type", "per_device_train_batch_size",
             "gradient_accumulation_steps", "disable_dropout")),
    Section("Memory and speed of the update",
            "Memory and speed of the update (docs/howto/memory.md, docs/howto/speed.md).",
            ("gradient_checkpointing", "gradient_checkpointing_layers", "max_memory_gib",
             "max_tokens_per_micro_batch", "torch_compile", "free_sampling_memory", "lend_kv_cache", "gc_freeze",
             "offload_ref_model", "fused_head_loss", "share_prompt_prefix")),
    Section("Mixture-of-experts models",
            "Mixture-of-experts models (Qwen3-MoE and Mixtral, cohort_grpo/models/moe.py); ignored for dense "
            "models.",
            ("routing_replay", "router_aux_loss_coef")),
    Section("Vision-language models",
            "Vision-language models (Qwen-VL, Gemma 3, SmolVLM, LLaVA, ...: cohort_grpo/models/vision_language.py; "
            "docs/howto/vision.md); ignored for text models.",
            ("freeze_vision_tower",)),
    Section("LoRA through peft, with TRL's ModelConfig names",
            "LoRA through peft, with TRL's ModelConfig names; π_ref is then the same model with the adapters "
            "off.",
            ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")),
    Section("Seed, devices, processes and precision",
            "Seed, devices, processes and precision. Several processes (torchrun, or --nproc_per_node N): DDP"
            " by default; fsdp shards parameters, gradients and optimizer state (FSDP2) for models one GPU "
            "can't train.",
            ("seed", "device", "cpu_threads", "full_determinism", "fsdp", "ddp_timeout", "dtype")),
    Section("Book-keeping",
            "",
            ("logging_steps", "log_completions_steps", "save_strategy", "save_steps", "eval_strategy", "eval_steps",
             "eval_limit", "report_to", "quiet")),
    Section("Never lose a run",
            "Never lose a run (docs/reliability.md): checkpoints, resume, local faults, safe loading.",
            ("save_total_limit", "resume", "resume_from_checkpoint", "overwrite_output_dir", "push_to_hub",
             "hub_model_id", "hub_token", "hub_private_repo", "max_consecutive_nonfinite", "trust_remote_code",
             "model_impl")),
    Section("Curriculum",
            "Curriculum (cohort_grpo/tasks/curriculum.py): stages {task, steps, <load options>} trained in turn.",
            ("curriculum",)),
)
