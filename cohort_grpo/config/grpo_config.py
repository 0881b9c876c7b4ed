"""`GRPOConfig`: every knob of a run, with TRL's names where the concept is the same.

A config comes from Python (`GRPOConfig(learning_rate=...)`), or from the command line and YAML
(`cohort_grpo.config.command_line.resolve_config`, with one precedence rule for every option and the
source of each value). `validate()` returns a checked copy (values outside the table of
cohort_grpo/config/choices.py and configs the table of cohort_grpo/config/rules.py refuses are one-line
`CohortError`s, which the constructor raises already) and never changes the object it is called on; the
`auto` options are settled later, once, by `cohort_grpo.run.resolve.resolve_run_config`, and the step counts
(fractions of the run, save and eval strategies) once the run's length is known
(`cohort_grpo.config.step_counts.with_step_counts`). A stage that takes a group of options as one value gets it
from here (`reward_model()`, cohort_grpo/config/settings.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field

from cohort_grpo.config.choices import CHOICES, choose
from cohort_grpo.errors import CohortError
from cohort_grpo.config.output_dir import DESCRIPTION, script_output_dir
from cohort_grpo.config.rules import RULES, first_refusal
from cohort_grpo.config.settings import RewardModelSettings
from cohort_grpo.config.spelling import learn_options
from cohort_grpo.config.trl_names import translate
from cohort_grpo.config.types import fits, type_problem

# rollout_numerics' default: "fast" until the exact path's speed is measured on a GPU (docs/performance.md);
# this one line is what changes when it becomes the default.
DEFAULT_ROLLOUT_NUMERICS = "fast"


@dataclass
class GRPOConfig:
    # Each block below is a section of `cohort-grpo train --help` and docs/reference.md, in the same order: its
    # title, description and options are cohort_grpo/config/sections.py's SECTIONS.

    # What to train, on what.
    model: str | None = field(default=None, metadata={
        "help": "The policy: a local Hugging Face folder, a hub id or a .gguf file; None is the built-in tiny model."})
    task: str | None = field(default=None, metadata={
        "help": "The task that supplies prompts, reward functions and the held-out verifier: arithmetic, "
                "calculator (tool calls: the built-in cohort:tiny-tools model learns to use a calculator), gsm8k, "
                "shapes (vision: count one colour's shapes in a drawn picture, on cohort:tiny-vision), "
                "reasoning_gym:NAME (reasoning-gym's generators; a mixture reasoning_gym:A:2,B:1), "
                "verifiers:ENV_ID (an installed verifiers environment, its rubric the rewards) "
                "or generic (your rows and --reward_funcs, no verifier); None is generic when data_files or "
                "dataset_name is given, else arithmetic."})
    data_files: str | None = field(default=None, metadata={
        "help": "Local training rows: .jsonl, .json, .parquet or .csv file(s), comma-separated or a glob."})
    dataset_name: str | None = field(default=None, metadata={
        "help": "Instead of data_files: a Hugging Face Hub dataset (datasets.load_dataset; the hub extra, online)."})
    dataset_config: str | None = field(default=None, metadata={
        "help": "The hub dataset's configuration (load_dataset's name), e.g. main for openai/gsm8k."})
    dataset_train_split: str = field(default="train", metadata={
        "help": "The split trained on: of dataset_name, of a task's own data, or a key of split-mapped files."})
    dataset_test_split: str = field(default="test", metadata={
        "help": "The held-out split evaluated on, when the task has a verifier and eval_data_files is not given."})
    prompt_column: str = field(default="prompt", metadata={
        "help": "Generic task: the column holding each prompt (text or chat messages), renamed to prompt; the "
                "other columns reach the reward functions as keyword arguments."})
    eval_data_files: str | None = field(default=None, metadata={
        "help": "Held-out rows for evaluation; None uses the task's own test split, never data_files."})
    subset: int | None = field(default=None, metadata={
        "help": "Train on N of the training rows, chosen by the seed; None uses them all."})
    levels: str = field(default="3", metadata={
        "help": "Arithmetic task: the difficulty levels (1-6) trained on, comma-separated."})
    output_dir: str = field(default_factory=script_output_dir, metadata={
        "help": "Folder of the run: metrics.jsonl, completions.jsonl, checkpoints and the final policy. From "
                "Python the default is runs/<script name> (runs/cohort without a script file, as in an "
                "interactive session); cohort-grpo train's is runs/<task> for a built-in task, else runs/cohort.",
        "default_text": DESCRIPTION})

    # Algorithm 1.
    num_generations: int = field(default=8, metadata={
        "help": "G: completions sampled per prompt, one group whose rewards give the advantages."})
    num_iterations: int = field(default=1, metadata={
        "help": "μ: policy updates on each rollout; π_old's log-probs are computed once per step when μ > 1."})
    ref_reset_steps: int = field(default=0, metadata={
        "help": "M: steps per outer iteration, at whose start π_ref ← π_θ; 0 never resets π_ref."})
    max_steps: int = field(default=100, metadata={
        "help": "GRPO steps in the run (I·M in Algorithm 1)."})
    num_train_epochs: float | None = field(default=None, metadata={
        "help": "TRL's: instead of max_steps, this many passes over the training rows (steps = epochs × rows ÷ "
                "prompts per step, rounded up), max_steps then unused; None counts max_steps."})
    epsilon: float = field(default=0.2, metadata={
        "help": "ε: the importance ratio is clipped to [1 − ε, 1 + epsilon_high]."})
    epsilon_high: float | None = field(default=None, metadata={
        "help": "Upper clip bound; above epsilon it is DAPO's clip-higher, None uses epsilon (a symmetric clip)."})
    beta: float = field(default=0.0, metadata={
        "help": "β: weight of the k3 estimate of KL(π_θ‖π_ref) in the loss; 0 builds no reference model at all."})
    loss_type: str = field(default="grpo", metadata={
        "help": "Loss aggregation: grpo (mean per completion, then over completions), bnpo or dapo (per token "
                "over the batch), dr_grpo (sum over tokens ÷ completions × max_completion_length)."})
    scale_rewards: str | bool = field(default="group", metadata={
        "help": "Divisor of the centred rewards: group (the group's std, GRPO), batch (the batch's std) or none "
                "(Dr. GRPO); TRL's true and false mean group and none."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward functions: built-in names, module:function, or reward-model folders; None uses the task's."})
    reward_weights: list[float] | None = field(default=None, metadata={
        "help": "Weight of each reward function in the total reward; None weighs each 1 (or the task's weights)."})
    reward_timeout: float = field(default=10.0, metadata={
        "help": "Seconds a reward call may take (a whole-batch call, or one sample of a per-sample function) "
                "before its samples score None."})

    # Reward faults.
    reward_errors: str = field(default="raise", metadata={
        "help": "What a reward function that raises does: raise stops the run at its first exception with one line "
                "naming the function; warn scores the samples it fails on None and counts them in "
                "rewards/<name>/errors. A reward call that times out is not an error: it scores None either way."})

    # Tools.
    tools: list[str] | None = field(default=None, metadata={
        "help": "Tools the model may call while sampling: module:function (typed, with a Google-style docstring; "
                "sync or async) or run_python (the sandboxed code tool); None uses the task's tools, if any."})
    environment: str | None = field(default=None, metadata={
        "help": "module:Class built once per completion (TRL's environment_factory): reset(**row) starts it, its "
                "public methods are tools, an optional get_reward() adds its score to the reward."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={
        "help": "Most tool-calling turns per completion; None: as many as max_completion_length allows."})
    tool_timeout: float = field(default=30.0, metadata={
        "help": "Seconds a tool call may take; a call that overruns is a failed call whose error the model sees."})

    # Asynchronous rollouts.
    async_rollouts: bool = field(default=False, metadata={
        "help": "Sample the rollouts of later steps on a copy of the policy while the update trains; the update "
                "corrects for the stale samples by importance sampling against the sampler's log-probs."})
    rollout_gpus: int = field(default=0, metadata={
        "help": "With async_rollouts under torchrun: the last K ranks only sample (the engine), the others train; "
                "weights go to the samplers over NCCL after each update (cohort_grpo/parallel/disaggregation.py)."})
    rollout_tensor_parallel_size: int | str = field(default="auto", metadata={
        "help": "With rollout_gpus: the sampling ranks form groups of this many, each group one engine over a "
                "tensor-parallel split of the model (attention heads, MLP columns and the vocabulary; "
                "cohort_grpo/models/tensor_parallel.py), for a model whose weights and KV cache do not fit one GPU. "
                "It must divide rollout_gpus. With fsdp and no rollout_gpus (colocated): consecutive training "
                "ranks sample in groups of this many, each keeping only its shard; it must divide the number of "
                "ranks. auto: the smallest whose ranks keep, beside their share of the weights, the KV cache of a "
                "useful batch (64 sequences decoded at once, or a call's sequences where fewer; 1 where one GPU "
                "holds them; cohort_grpo/plans/sampling_plan.py)."})
    max_concurrent_sequences: int | str = field(default="auto", metadata={
        "help": "Most sequences one engine decodes at once (its KV-cache slots); the others of a sampling call wait "
                "for a slot (continuous batching), with the same tokens. auto: as many as fit the memory the "
                "weights (and, on a rank that also trains, the step's training state) leave, at most 256, "
                "rounded down to a CUDA-graph width (cohort_grpo/plans/sampling_plan.py)."})
    max_staleness: int | None = field(default=None, metadata={
        "help": "With async_rollouts: how many policy updates behind the trained policy the samples are (the "
                "rollout of step t is sampled from the weights after update t - 1 - max_staleness). None: 2 with "
                "partial rollouts, else 1."})
    partial_rollouts: bool | str = field(default="auto", metadata={
        "help": "With rollout_gpus: a step trains the first groups to complete and the others go on in the next "
                "sampling call, so no step waits for the longest completion (cohort_grpo/rollout/partial.py). Requests "
                "then go out 1 update ahead and a group is carried while its oldest tokens stay within "
                "max_staleness (2 or more). auto: on with rollout_gpus where cohort's engine samples, without "
                "tools, unless max_staleness is set below 2."})

    # Algorithm breadth.
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."})
    max_resample_tries: int = field(default=4, metadata={
        "help": "Extra sampling rounds per step that dynamic_sampling may take to refill the batch."})
    overlong_buffer_length: int = field(default=0, metadata={
        "help": "DAPO's soft overlong punishment over the last N tokens before max_completion_length; 0 is off."})
    overlong_penalty_factor: float = field(default=1.0, metadata={
        "help": "Scale of the overlong penalty, which reaches −factor at max_completion_length."})
    mask_truncated_completions: bool = field(default=False, metadata={
        "help": "Leave completions cut at max_completion_length out of the loss."})
    importance_sampling_level: str = field(default="token", metadata={
        "help": "Importance ratio per token (GRPO) or per sequence (GSPO: the geometric mean over the completion)."})
    entropy_coef: float = field(default=0.0, metadata={
        "help": "Entropy bonus: the loss subtracts coef × the mean token entropy of the policy."})
    delta: float | None = field(default=None, metadata={
        "help": "Two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta too; None is off. "
                "Set it above 1 + epsilon_high."})
    use_bias_correction_kl: bool = field(default=False, metadata={
        "help": "Weigh each token's KL term by the importance ratio (DeepSeek-V3.2's unbiased KL gradient); off "
                "keeps DeepSeekMath's β·KL (TRL 1.16 defaults to on)."})

    # On-policy distillation.
    teacher_model: str | None = field(default=None, metadata={
        "help": "A teacher that scores every token the policy samples (on-policy distillation): a local folder, a hub "
                "id or a built-in name such as cohort:tiny-arithmetic, of the policy's vocabulary; loaded frozen on "
                "the policy's device, never checkpointed. From Python also a loaded model "
                "(GRPOTrainer(teacher_model=...)). Needs distillation_coef > 0."})
    teacher_model_init_kwargs: dict | None = field(default=None, metadata={
        "help": "TRL's: how the named teacher loads; cohort takes only dtype (or torch_dtype) there: float32, "
                "bfloat16 or auto (the policy's weights' dtype, the default)."})
    distillation_coef: float = field(default=0.0, metadata={
        "help": "c: each sampled token's advantage gains c × (log π_teacher − log π_old) of that token (Thinking "
                "Machines' on-policy distillation); 0 is off. With no reward functions (reward_funcs=[]; "
                "--reward_funcs '') and 1 it is pure on-policy distillation."})
    distillation_discount: float = field(default=0.0, metadata={
        "help": "γ in [0, 1]: a token's distillation advantage is its own term plus γ × the next sampled token's "
                "advantage (a discounted sum to the end of the completion); 0, the recipe's, credits each token "
                "with its own term only."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "TRL's (GKDConfig) name for teacher_model."})

    # The sampler computes in other kernels than the trainer.
    importance_sampling_correction: bool | None = field(default=None, metadata={
        "help": "Weigh the surrogate by π_trainer / π_sampler of each sample; None turns it on where the sampler "
                "is not exact (a bf16 or fp16 policy on a GPU)."})
    importance_sampling_mode: str = field(default="token_truncate", metadata={
        "help": "How the sampler correction weighs: token_truncate, token_mask, sequence_truncate or "
                "sequence_mask (ratios clipped to [clip_min, clip_max], or samples outside it dropped)."})
    importance_sampling_clip_min: float | None = field(default=None, metadata={
        "help": "Lower bound C_min of the sampler correction's ratio; None is no lower bound."})
    importance_sampling_clip_max: float | None = field(default=3.0, metadata={
        "help": "Upper bound C_max of the sampler correction's ratio; None is no upper bound (mask modes only)."})
    vllm_importance_sampling_correction: bool | None = field(default=None, metadata={
        "help": "TRL's name for importance_sampling_correction (accepted so a TRL config ports unchanged)."})
    vllm_importance_sampling_mode: str | None = field(default=None, metadata={
        "help": "TRL's name for importance_sampling_mode."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={
        "help": "TRL's name for importance_sampling_clip_min."})
    vllm_importance_sampling_clip_max: float | None = field(default=None, metadata={
        "help": "TRL's name for importance_sampling_clip_max."})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={
        "help": "TRL's older name for importance_sampling_clip_max."})

    rollout_numerics: str = field(default=DEFAULT_ROLLOUT_NUMERICS, metadata={
        "help": "fast: the engine and the trainer each run their fastest kernels, and their bf16 log-probs differ "
                "slightly (the correction above weighs it). exact: both compute every token with the same "
                "batch-invariant kernels (matmul, RMSNorm, attention, LM-head log-softmax; no torch.compile), so the "
                "sampler's log-prob equals the trainer's log π_old bit for bit (our models on a GPU, one engine per "
                "GPU, no LoRA; docs/concepts.md)."})

    # Learned reward model r_φ.
    rm_updates_per_step: int = field(default=0, metadata={
        "help": "k: r_φ optimizer steps after each policy step; 0 keeps r_φ frozen, as in TRL."})
    rm_buffer_size: int = field(default=4096, metadata={
        "help": "Samples the replay buffer holds at most."})
    rm_buffer_policy: str = field(default="fifo", metadata={
        "help": "Which samples the full buffer keeps: fifo (the newest) or reservoir (uniform over all seen)."})
    rm_replay_ratio: float = field(default=0.5, metadata={
        "help": "Fraction of each r_φ mini-batch drawn from the replay buffer; the rest is this step's samples."})
    rm_batch_size: int = field(default=32, metadata={
        "help": "Samples (pointwise) or pairs (pairwise) in each r_φ mini-batch."})
    rm_learning_rate: float = field(default=1e-4, metadata={
        "help": "Learning rate of r_φ's AdamW."})
    rm_loss: str = field(default="pointwise", metadata={
        "help": "r_φ's loss: pointwise (BCE on each sample's label) or pairwise (Bradley-Terry within a group)."})
    rm_label_fraction: float = field(default=1.0, metadata={
        "help": "Fraction of each step's groups that get rule labels for r_φ's training (labels that cost)."})
    rm_train_steps: int = field(default=0, metadata={
        "help": "Train r_φ only during the first N steps, then freeze it; 0 trains it throughout."})
    rm_max_length: int = field(default=512, metadata={
        "help": "Tokens r_φ reads at most: the end of prompt + completion."})
    rm_scorer: str = field(default="head", metadata={
        "help": "r_φ's score: head (a scalar head on the last token) or likelihood "
                "(a·log π_φ(completion|prompt) + b)."})
    rm_head_learning_rate: float | None = field(default=None, metadata={
        "help": "Learning rate of r_φ's score head; None uses rm_learning_rate."})
    rm_warmup_batches: int = field(default=0, metadata={
        "help": "Before step 1, label this many batches of the initial policy's samples and train r_φ on them."})
    rm_warmup_updates: int = field(default=200, metadata={
        "help": "r_φ mini-batch updates in that warm-up, after a linear probe of the head alone."})

    # Sampling.
    max_prompt_length: int = field(default=512, metadata={
        "help": "Longest prompt in tokens (after the chat template); the training rows are checked before step 1, "
                "and a longer one is an error naming its row and the fix (or see long_prompts)."})
    long_prompts: str = field(default="refuse", metadata={
        "help": "A prompt longer than max_prompt_length: refuse stops with one line naming it; truncate_left "
                "keeps its last max_prompt_length tokens, as TRL did up to 0.27 (TRL 1.16 has no limit)."})
    max_completion_length: int = field(default=256, metadata={
        "help": "New tokens per completion at most; a completion cut there counts as truncated."})
    temperature: float = field(default=1.0, metadata={
        "help": "Sampling temperature of the rollouts; must be > 0 (a group's completions must differ), e.g. 0.7-1.0."})
    top_p: float = field(default=1.0, metadata={
        "help": "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1.0 is off."})
    top_k: int = field(default=0, metadata={
        "help": "Sample among the k most likely tokens only; 0 is off, 1 (greedy) is refused."})
    min_p: float = field(default=0.0, metadata={
        "help": "Drop tokens less likely than min_p × the most likely token's probability; 0.0 is off, below 1."})
    chat_template_kwargs: dict | None = field(default=None, metadata={
        "help": "Keywords for the chat template wherever a chat is rendered: prompts, tool turns, evaluation "
                "(e.g. {enable_thinking: false} for Qwen3); a JSON object on the command line, where cohort-grpo eval "
                "and cohort-grpo sft take it too."})

    # Optimisation.
    learning_rate: float = field(default=1e-6, metadata={
        "help": "AdamW's learning rate for the policy."})
    weight_decay: float = field(default=0.0, metadata={
        "help": "AdamW's decoupled weight decay."})
    adam_beta1: float = field(default=0.9, metadata={
        "help": "AdamW's β1, the decay of the first moment."})
    adam_beta2: float = field(default=0.99, metadata={
        "help": "AdamW's β2, the decay of the second moment."})
    optimizer_state_dtype: str = field(default="auto", metadata={
        "help": "AdamW's moments: auto (bfloat16, rounded stochastically, where the weights are bf16 with fp32 "
                "masters, the GPU default; float32 otherwise), float32 or bfloat16."})
    offload_optimizer: bool | str = field(default="auto", metadata={
        "help": "Keep AdamW's state (moments, the masters' low halves) in host memory and stream each tensor's "
                "through the GPU for its step: 6 of the 10 bytes a bf16 parameter costs a GPU. auto: on where a "
                "one-GPU full-parameter step of our models could not otherwise keep its state and decode all its "
                "completions at once on the GPU (8B on 80 GB)."})
    max_grad_norm: float = field(default=1.0, metadata={
        "help": "Clip the gradient's global norm to this before each optimizer step."})
    warmup_steps: int | float = field(default=0, metadata={
        "help": "Steps of linear learning-rate warm-up from 0; a fraction in (0, 1) is that share of max_steps, "
                "rounded up (transformers' meaning)."})
    warmup_ratio: float = field(default=0.0, metadata={
        "help": "TRL's: the warm-up as a share of max_steps (rounded up), used when warmup_steps is 0."})
    lr_scheduler_type: str = field(default="constant", metadata={
        "help": "Learning-rate schedule after the warm-up: constant, cosine or linear (to 0 at max_steps)."})
    per_device_train_batch_size: int = field(default=16, metadata={
        "help": "Completions per micro-batch of the update; × gradient_accumulation_steps = completions per step."})
    gradient_accumulation_steps: int = field(default=4, metadata={
        "help": "Micro-batches per optimizer step; the step samples per_device_train_batch_size × this completions."})
    disable_dropout: bool = field(default=False, metadata={
        "help": "TRL's: turn off every dropout of the policy (its dropout layers, attention dropout and LoRA's), so "
                "the update's log π_θ is not a noisy draw beside π_old's and π_ref's, which run without it. "
                "cohort's own models have none; a transformers model keeps its config's unless this is set."})

    # Memory and speed of the update.
    gradient_checkpointing: bool | str = field(default="auto", metadata={
        "help": "Recompute decoder layers' activations in the backward instead of keeping them. auto: on a GPU, "
                "our models recompute only the layers the memory budget needs (gradient_checkpointing_layers=auto) "
                "and other models every layer (TRL's default); off on a CPU."})
    gradient_checkpointing_layers: int | str | None = field(default=None, metadata={
        "help": "Our models, with gradient_checkpointing: recompute only the first N decoder layers and let the "
                "later ones keep their activations (faster, more memory); auto (GPU) measures a kept layer's cost "
                "in the first update and keeps as many as fit under max_memory_gib; None recomputes every layer."})
    max_memory_gib: float = field(default=0.0, metadata={
        "help": "The update's peak that gradient_checkpointing_layers=auto aims under, in GiB; 0 is 90% of the GPU."})
    max_tokens_per_micro_batch: int | str = field(default="auto", metadata={
        "help": "Cap on each micro-batch's padded tokens besides its rows (0 caps rows only). auto: on a GPU with our "
                "models, about 1.1e14 FLOPs of work (11,776 tokens at 1.5B; a mixture of experts counts the weights "
                "a token passes through), enough to hide each micro-batch's host cost, for much less memory; 0 "
                "elsewhere. Out of GPU memory, rows and cap halve and the step is redone."})
    torch_compile: bool | str = field(default="auto", metadata={
        "help": "Compile each decoder layer's training forward and backward with torch.compile (our models; "
                "needs triton on a GPU). auto: on with our models on a GPU where triton is installed, else off."})
    free_sampling_memory: bool = field(default=False, metadata={
        "help": "On a GPU, free the engine's KV cache and CUDA graphs after each rollout: less memory in the "
                "update, a recapture each step. Under FSDP2 (synchronous) the engine's weights too, until the "
                "refresh after the update rewrites them."})
    lend_kv_cache: bool = field(default=True, metadata={
        "help": "One process: the update's gradients live in the engine's KV cache, idle between rollouts."})
    gc_freeze: bool = field(default=True, metadata={
        "help": "After the first step, Python's garbage collector stops walking the run's long-lived objects."})
    offload_ref_model: bool = field(default=True, metadata={
        "help": "On a GPU, π_ref's weights wait in pinned host memory between its passes and come back while "
                "the engine samples."})
    fused_head_loss: bool = field(default=True, metadata={
        "help": "Our models, token-level ratios: take the LM head's gradient in its forward pass, chunk by chunk."})
    share_prompt_prefix: bool = field(default=True, metadata={
        "help": "Our models: compute each prompt once per group in the log-prob passes and the update."})

    # Mixture-of-experts models.
    routing_replay: bool = field(default=True, metadata={
        "help": "The trainer's forwards (π_old, π_θ, π_ref) route each token by the experts the sampler chose "
                "for it, the router still trained through the gate values."})
    router_aux_loss_coef: float = field(default=0.0, metadata={
        "help": "Weight of the Switch Transformer load-balancing loss added to the policy loss; 0 leaves it out, "
                "as RL frameworks do."})

    # Vision-language models.
    freeze_vision_tower: bool = field(default=True, metadata={
        "help": "A vision-language model's vision tower keeps its weights (only the language tower trains); false "
                "trains it too (full fine-tuning; LoRA adapts the language tower only)."})

    # LoRA through peft, with TRL's ModelConfig names.
    use_peft: bool = field(default=False, metadata={
        "help": "Train LoRA adapters (peft) instead of every weight."})
    lora_r: int = field(default=16, metadata={
        "help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={
        "help": "LoRA scaling numerator: the adapters' update is scaled by lora_alpha / lora_r."})
    lora_dropout: float = field(default=0.05, metadata={
        "help": "Dropout on the adapters' input."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Module names that get adapters; None is every attention and MLP projection."})

    # Seed, devices, processes and precision.
    seed: int = field(default=42, metadata={
        "help": "Seed of the data order, the sampling and the global random generators."})
    device: str = field(default="auto", metadata={
        "help": "auto, cpu, cuda or cuda:N; under torchrun each process takes cuda:LOCAL_RANK."})
    cpu_threads: int | str = field(default="auto", metadata={
        "help": "PyTorch's threads on a CPU run. auto: one fewer than the cores this process may use (at least "
                "one), so that another busy program slows training by about the core it takes, not many times "
                "over; OMP_NUM_THREADS, when set, is the count instead. The same count gives the same numbers, "
                "busy or not."})
    full_determinism: bool = field(default=False, metadata={
        "help": "Bit-for-bit repeatable runs on GPUs too (a resumed run then equals the uninterrupted one there): "
                "PyTorch's deterministic algorithms and cuBLAS's fixed workspace, at some speed. CPU runs repeat "
                "anyway."})
    fsdp: bool = field(default=False, metadata={
        "help": "Several processes: shard parameters, gradients and optimizer state with FSDP2 instead of DDP."})
    ddp_timeout: int = field(default=1800, metadata={
        "help": "Seconds any wait on another rank lasts before the job stops (collectives, rollout messages, the "
                "weight broadcast to sampling ranks; transformers' name)."})
    dtype: str = field(default="auto", metadata={
        "help": "Weights' dtype: auto (bf16 with fp32 master weights on a GPU, fp32 on a CPU), "
                "float32 or bfloat16."})

    # Book-keeping.
    logging_steps: int | float = field(default=1, metadata={
        "help": "Every N steps (and at the last step), append a line to metrics.jsonl and print the step's line "
                "(the console also shows the first step); a fraction in (0, 1) is that share of max_steps, rounded "
                "up (transformers' meaning)."})
    log_completions_steps: int | float = field(default=10, metadata={
        "help": "Append sample completions with their rewards to completions.jsonl every N steps (a fraction "
                "in (0, 1): that share of max_steps)."})
    save_strategy: str = field(default="steps", metadata={
        "help": "When checkpoints are written (transformers' name): steps (every save_steps steps and after the "
                "last), epoch (after every pass over the training rows and the last step) or no (none during or "
                "at the end of training; the final policy is still written to output_dir, and a stop by a "
                "signal or a failure still saves one to resume from)."})
    save_steps: int | float = field(default=0, metadata={
        "help": "With save_strategy steps: write a checkpoint every N steps (a fraction in (0, 1): that share of "
                "max_steps, rounded up); 0 writes one only at the end."})
    eval_strategy: str | None = field(default=None, metadata={
        "help": "When the held-out rows are evaluated during training (transformers' name): steps (every "
                "eval_steps steps, or every logging_steps where eval_steps is 0), epoch (after every pass over "
                "the training rows) or no; None is steps where eval_steps is above 0, else no. Evaluation "
                "before and after training happens either way."})
    eval_steps: int | float = field(default=0, metadata={
        "help": "Evaluate on the held-out rows every N steps (a fraction in (0, 1): that share of max_steps, "
                "rounded up); 0 evaluates only before and after training (unless eval_strategy is steps)."})
    eval_limit: int = field(default=200, metadata={
        "help": "Held-out problems scored for accuracy at each evaluation."})
    report_to: str | list[str] = field(default="none", metadata={
        "help": "Where metrics go besides metrics.jsonl: none, tensorboard, wandb, all, or several of them (a "
                "list, or comma-separated)."})
    quiet: bool = field(default=False, metadata={
        "help": "No progress bars: only the per-step and per-iteration lines, as plain text."})

    # Never lose a run.
    save_total_limit: int = field(default=2, metadata={
        "help": "Keep the newest N checkpoint-<step> folders; 0 keeps all."})
    resume: bool = field(default=False, metadata={
        "help": "Continue from the newest complete checkpoint in output_dir (from step 0 when there is none)."})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "Continue from this checkpoint-<step> folder; latest is the same as resume."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start over in an output_dir that holds an unfinished run's checkpoints, deleting them. A "
                "finished run's (its last step saved) are replaced without it, as TRL writes over its output_dir."})
    push_to_hub: bool = field(default=False, metadata={
        "help": "Upload output_dir (the trained policy, metrics, summary; not the checkpoints) to the Hugging Face "
                "Hub when training ends, as transformers does (trainer.push_to_hub() does it any time)."})
    hub_model_id: str | None = field(default=None, metadata={
        "help": "The Hub repository to push to, name or namespace/name; None is output_dir's folder name."})
    hub_token: str | None = field(default=None, metadata={
        "help": "The Hub token to push with; None uses HF_TOKEN or the token huggingface_hub has stored."})
    hub_private_repo: bool | None = field(default=None, metadata={
        "help": "Make the repository private when push_to_hub creates it; None is the Hub's default."})
    max_consecutive_nonfinite: int = field(default=5, metadata={
        "help": "After this many non-finite updates in a row, save a checkpoint and stop the run."})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Let transformers run Python code shipped with a model repository."})
    model_impl: str = field(default="auto", metadata={
        "help": "auto, cohort (our models, or transformers' modules for other decoder-only types, and the KV-cache "
                "engine) or hf (transformers and HF generate)."})

    # Curriculum.
    curriculum: list[dict] | None = field(default=None, metadata={
        "help": "Stages trained in turn, a YAML list or arithmetic:50,gsm8k:200 (held-out evaluation: the last "
                "stage's task); None trains the one task above."})

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per step (prompts × G)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations

    def __setattr__(self, name, value):
        if self.__dict__.get("frozen_as_resolved"):
            raise CohortError(f"cannot set {name}: a trainer's resolved config is read-only; set it on the GRPOConfig "
                              "you build the trainer from (dataclasses.replace(trainer.args, ...) gives a copy)")
        super().__setattr__(name, value)

    def freeze(self) -> "GRPOConfig":
        """This config, read-only from now on (setting a field raises a one-line `CohortError`); the
        resolved config of a run is frozen, so every stage built from it reads the same values."""
        self.__dict__["frozen_as_resolved"] = True
        return self

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get("frozen_as_resolved"))

    def reward_model(self) -> RewardModelSettings:
        """The rm_* options as one checked value, what a learned reward model (`RewardModelReward`) takes."""
        return RewardModelSettings.of(self)

    def validate(self) -> "GRPOConfig":
        """A checked copy with its spellings settled (the task chosen from the data when unnamed, TRL's
        boolean scale_rewards and vllm_* names turned into cohort's, a curriculum parsed); contradictions
        are one-line `CohortError`s. This object is left as it is: a caller may reuse it. What needs the
        device or the model (the `auto` options) is settled later, by `cohort_grpo.run.resolve.resolve_run_config`."""
        changes: dict = {}
        for alias, _ in ALIASES:  # checked under the name given, before it hands its value on
            if alias in CHOICES and getattr(self, alias) is not None:
                choose(alias, getattr(self, alias))
        if self.task is None:
            changes["task"] = default_task(self.data_files, self.dataset_name)
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            # TRL's booleans, from Python, YAML (True) or the command line (true): True is group, False none.
            changes["scale_rewards"] = "group" if str(self.scale_rewards).lower() == "true" else "none"
        for name, values in CHOICES.items():  # "true"/"false" from Python or YAML as the command line reads them
            value = getattr(self, name)
            if "true" in values and isinstance(value, str) and value.lower() in ("true", "false"):
                changes[name] = value.lower() == "true"
        for alias, name in ALIASES:
            if getattr(self, alias) is not None:  # TRL's names: they set cohort's, then step aside
                changes[name], changes[alias] = getattr(self, alias), None
        if self.curriculum is not None:
            from cohort_grpo.config.curriculum import parse_curriculum

            changes["curriculum"] = parse_curriculum(self.curriculum)
        with unchecked():  # the copy is checked once, here
            config = dataclasses.replace(self, **changes)
        config.check()
        return config

    def check(self) -> None:
        """Raise a one-line `CohortError` for the first value of the wrong type, outside its fixed values
        (cohort_grpo/config/choices.py) or refused by a rule (cohort_grpo/config/rules.py: ranges, contradictions,
        unsupported combinations)."""
        self.check_types()
        hints = typing.get_type_hints(type(self))
        for name in CHOICES:
            value = getattr(self, name)
            if not (value is None and type(None) in typing.get_args(hints[name])):
                choose(name, value)
        message = first_refusal(RULES, self)
        if message is not None:
            raise CohortError(message)

    def check_types(self) -> None:
        """Raise a one-line `CohortError` naming the first option whose value is not of its type."""
        for name, hint in option_hints().items():
            problem = type_problem(name, getattr(self, name), hint)
            if problem:
                raise CohortError(problem)

    def to_dict(self) -> dict:
        """The fields as a dict; the hub token masked (the dict goes into metrics.jsonl and checkpoints)."""
        values = dataclasses.asdict(self)
        if values.get("hub_token") is not None:
            values["hub_token"] = "<HUB_TOKEN>"
        return values


@functools.cache
def option_hints() -> dict:
    return typing.get_type_hints(GRPOConfig)


def field_defaults() -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(GRPOConfig)}


def accepting_trl_names(init):
    """GRPOConfig's constructor taking TRL's keywords as well (cohort_grpo/config/trl_names.py) and checking
    each value where it is written (its type, its fixed values, the rules: what `validate` refuses), not where
    a later comparison or the trainer trips over it."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        kwargs = translate(kwargs, field_defaults())
        for name, value in kwargs.items():  # a pathlib.Path where a folder's name goes, as TRL takes it
            if isinstance(value, os.PathLike) and fits("", option_hints().get(name)):
                kwargs[name] = os.fspath(value)
        init(self, *args, **kwargs)
        self.check_types()
        if not deferred.get():
            self.validate()  # a refused value is refused where it is written, as TRL's GRPOConfig does, not later
    return __init__


deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("deferred", default=False)


@contextlib.contextmanager
def unchecked():
    """Within it GRPOConfig(...) checks the values' types only: `validate` builds its copy so and checks it
    itself, and `cohort-grpo train --help` shows the defaults of an invocation whatever it asks."""
    token = deferred.set(True)
    try:
        yield
    finally:
        deferred.reset(token)


GRPOConfig.__init__ = accepting_trl_names(GRPOConfig.__init__)
learn_options(lambda: {name: (hint, CHOICES.get(name, ())) for name, hint in option_hints().items()})


# TRL's names that set cohort's field, then step aside (validate).
ALIASES = (("vllm_importance_sampling_correction", "importance_sampling_correction"),
           ("vllm_importance_sampling_mode", "importance_sampling_mode"),
           ("vllm_importance_sampling_clip_min", "importance_sampling_clip_min"),
           ("vllm_importance_sampling_clip_max", "importance_sampling_clip_max"),
           ("vllm_importance_sampling_cap", "importance_sampling_clip_max"),
           ("teacher_model_name_or_path", "teacher_model"))

def default_task(data_files, dataset_name) -> str:
    """The task when none is named: your rows (generic) when data is given, else the built-in arithmetic."""
    return "generic" if data_files is not None or dataset_name is not None else "arithmetic"


field = field  # re-exported for users subclassing GRPOConfig
