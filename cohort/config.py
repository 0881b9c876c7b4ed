"""`GRPOConfig`: every knob of a run, with TRL's names where the concept is the same.

A config comes from Python (`GRPOConfig(learning_rate=...)`), from the command line
(`--learning_rate 1e-5`, dashes accepted) or from YAML (`--config run.yaml`); command-line flags
override the file. `validate()` turns contradictions into one-line `CohortError`s.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .algo import IMPORTANCE_LEVELS, LOSS_TYPES, SCALE_CHOICES
from .errors import CohortError


@dataclass
class GRPOConfig:
    # What to train, on what.
    model: str | None = None  # local HF folder, hub id or .gguf; None → the built-in tiny model
    task: str = "arithmetic"
    data_files: str | None = None  # local JSONL/parquet of training rows for the task (e.g. GSM8K)
    eval_data_files: str | None = None  # held-out rows; None → the task's own test split (never data_files)
    subset: int | None = None  # use N training rows
    levels: str = "3"  # arithmetic: difficulty levels trained on
    output_dir: str = "runs/cohort"

    # Algorithm 1.
    num_generations: int = 8  # G: completions per prompt
    num_iterations: int = 1  # μ: policy updates per rollout
    ref_reset_steps: int = 0  # M: steps between π_ref ← π_θ (0 = never)
    max_steps: int = 100
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None → epsilon (symmetric clip)
    beta: float = 0.0  # KL coefficient; 0 builds no reference model at all
    loss_type: str = "grpo"
    scale_rewards: str = "group"
    reward_funcs: list[str] | None = None  # names or module:function; None → the task's own
    reward_weights: list[float] | None = None
    reward_timeout: float = 10.0

    # Algorithm breadth (issue 10): DAPO, GSPO, entropy bonus. Defaults leave plain GRPO unchanged.
    dynamic_sampling: bool = False  # DAPO: drop all-equal-reward groups, sample more prompts to refill
    max_resample_tries: int = 4  # extra sampling rounds per step for dynamic_sampling
    overlong_buffer_length: int = 0  # DAPO soft overlong punishment over the last N tokens (0 = off)
    overlong_penalty_factor: float = 1.0  # scale of that penalty (reaches −factor at max_completion_length)
    mask_truncated_completions: bool = False  # completions cut at max_completion_length leave the loss
    importance_sampling_level: str = "token"  # token (GRPO) | sequence (GSPO)
    entropy_coef: float = 0.0  # entropy bonus: loss −= coef · mean token entropy

    # Learned reward model r_φ (issue 7): a reward_funcs entry that is a model folder or object, trained
    # online on rule-labelled samples with replay (Algorithm 1, line 12). See cohort/rewards/model.py.
    rm_updates_per_step: int = 0  # k: r_φ optimizer steps after each policy step (0 = frozen, as in TRL)
    rm_buffer_size: int = 4096  # replay buffer bound, in samples
    rm_buffer_policy: str = "fifo"  # fifo (newest kept) | reservoir (uniform over all seen)
    rm_replay_ratio: float = 0.5  # fraction of each r_φ mini-batch drawn from the buffer
    rm_batch_size: int = 32  # samples (pointwise) or pairs (pairwise) per r_φ mini-batch
    rm_learning_rate: float = 1e-4
    rm_loss: str = "pointwise"  # pointwise (BCE on the label) | pairwise (Bradley-Terry within a group)
    rm_label_fraction: float = 1.0  # fraction of each step's groups given rule labels (costly labels)
    rm_train_steps: int = 0  # train r_φ only during the first N steps, then freeze it (0 = always)
    rm_max_length: int = 512  # r_φ reads at most this many tokens (the end of prompt + completion)
    rm_scorer: str = "head"  # head (scalar head on the last token) | likelihood (a·log π_φ(completion|prompt)+b)
    rm_head_learning_rate: float | None = None  # the score head's learning rate (None = rm_learning_rate)
    rm_warmup_batches: int = 0  # before step 1: label this many batches of the initial policy, train r_φ on them
    rm_warmup_updates: int = 200  # r_φ mini-batch updates in that warm-up (after a head-only linear probe)

    # Sampling.
    max_prompt_length: int = 512
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    # Optimisation.
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant"  # constant | cosine | linear
    per_device_train_batch_size: int = 16  # completions per micro-batch
    gradient_accumulation_steps: int = 4  # micro-batches per optimizer step
    gradient_checkpointing: bool = False
    # Our models: recompute only the first N decoder layers in the backward; the later ones keep their
    # activations (Megatron's block recomputation). Fewer recomputed layers: faster, more memory. None = all.
    # "auto" (our models, GPU): measure what a kept layer costs in the first update, then keep as many
    # as fit under max_memory_gib (cohort/kept_layers.py).
    gradient_checkpointing_layers: int | str | None = None
    max_memory_gib: float = 0.0  # the update's peak that gradient_checkpointing_layers=auto aims under (0 = 90% of the GPU)
    # Update-phase memory (issue 5): micro-batches are bucketed by length; this caps each one's padded
    # tokens as well (0 = rows only). Out of GPU memory, both halve and the step is redone.
    max_tokens_per_micro_batch: int = 0
    torch_compile: bool = False  # compile each decoder layer's training forward/backward (our models; needs triton on GPU)
    free_sampling_memory: bool = False  # on GPU, free the engine's KV cache and graphs after each rollout (slower)
    lend_kv_cache: bool = True  # one process: the update's gradients live in the engine's idle KV cache (lending.py)
    gc_freeze: bool = True  # after the first step, Python's collector stops walking the run's long-lived objects (gc_pauses.py)
    offload_ref_model: bool = True  # on GPU: π_ref's weights wait in pinned host memory between its passes (offload.py)
    fused_head_loss: bool = True  # our models, token-level ratios: the LM head's gradient in its forward pass (head_loss.py)
    share_prompt_prefix: bool = True  # our models: one forward of each prompt per group in the full-sequence passes (packing.py)
    # LoRA through peft (TRL's ModelConfig names); π_ref is then the same model with adapters off.
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None  # None → every attention and MLP projection
    seed: int = 42
    device: str = "auto"  # auto | cpu | cuda (several processes under torchrun: one GPU each, cuda:LOCAL_RANK)
    # Several processes (issue 6, cohort/distributed.py; launch with torchrun or --nproc_per_node N): DDP
    # by default; fsdp shards parameters, gradients and optimizer state (FSDP2) for models one GPU can't train.
    fsdp: bool = False
    ddp_timeout: int = 1800  # seconds a collective waits for the other ranks before failing (transformers' name)
    dtype: str = "auto"  # auto (bf16 weights + fp32 master weights and AdamW state on GPU; fp32 on CPU) | float32 | bfloat16

    # Book-keeping.
    logging_steps: int = 1
    log_completions_steps: int = 10  # sample completions to completions.jsonl every N steps
    save_steps: int = 0  # 0 → only at the end
    eval_steps: int = 0  # 0 → only before and after
    eval_limit: int = 200  # held-out problems for accuracy
    report_to: str = "none"
    quiet: bool = False

    # Never lose a run (issue 8, docs/reliability.md): checkpoints, resume, local faults, safe loading.
    save_total_limit: int = 2  # keep the newest N checkpoint-<step> folders (0 = keep all)
    resume: bool = False  # continue from the newest complete checkpoint in output_dir
    resume_from_checkpoint: str | None = None  # a checkpoint-<step> folder, or "latest" (= --resume)
    overwrite_output_dir: bool = False  # start over in an output_dir that holds an earlier run's checkpoints
    max_consecutive_nonfinite: int = 5  # this many non-finite updates in a row: save a checkpoint and stop
    trust_remote_code: bool = False  # let transformers run Python code shipped with a model repo
    model_impl: str = "auto"  # auto | cohort (our models + the fast engine) | hf (transformers + HF generate)

    # Curriculum (issue 3, cohort/curriculum.py): stages {task, steps, <load options>} trained in turn;
    # YAML list or `--curriculum arithmetic:50,gsm8k:200`. None → the one task above for every step.
    curriculum: list[dict] | None = None

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per step (prompts × G)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations

    def validate(self) -> "GRPOConfig":
        def bad(msg: str) -> None:
            raise CohortError(msg)

        if self.num_generations < 2:
            bad(f"num_generations={self.num_generations}: GRPO needs at least 2 completions per prompt to form a group")
        if self.generation_batch_size % self.num_generations:
            bad(
                f"per_device_train_batch_size × gradient_accumulation_steps = {self.generation_batch_size} completions "
                f"is not divisible by num_generations={self.num_generations}; make it a multiple"
            )
        if self.loss_type not in LOSS_TYPES:
            bad(f"unknown loss_type {self.loss_type!r}; choose one of {list(LOSS_TYPES)}")
        if self.scale_rewards not in SCALE_CHOICES:
            bad(f"unknown scale_rewards {self.scale_rewards!r}; choose one of {list(SCALE_CHOICES)}")
        if self.use_peft and self.lora_r < 1:
            bad(f"lora_r={self.lora_r}: the LoRA rank must be at least 1")
        if self.max_tokens_per_micro_batch < 0:
            bad(f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} is negative; use 0 (no token cap) or a "
                "token budget such as 16384")
        if isinstance(self.gradient_checkpointing_layers, str) and self.gradient_checkpointing_layers != "auto":
            bad(f"gradient_checkpointing_layers={self.gradient_checkpointing_layers!r} is neither a layer count nor "
                "'auto'; pass a number such as 20, or auto")
        if self.max_memory_gib < 0 or (self.max_memory_gib and self.gradient_checkpointing_layers != "auto"):
            bad(f"max_memory_gib={self.max_memory_gib} is only the budget of gradient_checkpointing_layers=auto and "
                "must be ≥ 0; pass --gradient_checkpointing_layers auto with it, or leave it at 0")
        if isinstance(self.gradient_checkpointing_layers, int) and self.gradient_checkpointing_layers < 0:
            bad(f"gradient_checkpointing_layers={self.gradient_checkpointing_layers} is negative; use 0 (no layer "
                "recomputed) up to the model's layer count, or leave it unset to recompute every layer")
        if self.gradient_checkpointing_layers is not None and not self.gradient_checkpointing:
            bad(f"gradient_checkpointing_layers={self.gradient_checkpointing_layers} does nothing without "
                "gradient_checkpointing; pass --gradient_checkpointing true as well")
        if self.beta < 0:
            bad(f"beta={self.beta} is negative; the KL coefficient must be ≥ 0")
        if not 0 < self.epsilon < 1:
            bad(f"epsilon={self.epsilon} must lie in (0, 1)")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            bad(f"epsilon_high={self.epsilon_high} is below epsilon={self.epsilon}; clip-higher needs epsilon_high ≥ epsilon")
        for name in ("num_iterations", "max_steps", "max_completion_length", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "max_prompt_length", "logging_steps", "log_completions_steps"):
            if getattr(self, name) < 1:
                bad(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("ref_reset_steps", "save_steps", "eval_steps", "warmup_steps", "eval_limit"):
            if getattr(self, name) < 0:
                bad(f"{name}={getattr(self, name)} must be ≥ 0")
        if self.save_total_limit < 0 or self.max_consecutive_nonfinite < 1:
            bad(f"save_total_limit={self.save_total_limit} must be ≥ 0 and max_consecutive_nonfinite="
                f"{self.max_consecutive_nonfinite} at least 1")
        if self.overwrite_output_dir and (self.resume or self.resume_from_checkpoint):
            bad("overwrite_output_dir and resume contradict each other: resume continues the earlier run, "
                "overwrite_output_dir deletes it; pass only one")
        if self.ddp_timeout < 1:
            bad(f"ddp_timeout={self.ddp_timeout} must be at least 1 second")
        if self.temperature < 0:
            bad(f"temperature={self.temperature} must be ≥ 0")
        if not 0 < self.top_p <= 1:
            bad(f"top_p={self.top_p} must lie in (0, 1]")
        if self.learning_rate <= 0:
            bad(f"learning_rate={self.learning_rate} must be positive")
        if self.lr_scheduler_type not in ("constant", "cosine", "linear"):
            bad(f"unknown lr_scheduler_type {self.lr_scheduler_type!r}; choose constant, cosine or linear")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.model_impl not in ("auto", "cohort", "hf"):
            bad(f"unknown model_impl {self.model_impl!r}; choose auto, cohort or hf")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad(f"unknown dtype {self.dtype!r}; choose auto, float32 or bfloat16")
        if self.importance_sampling_level not in IMPORTANCE_LEVELS:
            bad(f"unknown importance_sampling_level {self.importance_sampling_level!r}; choose token or sequence")
        if self.max_resample_tries < 0:
            bad(f"max_resample_tries={self.max_resample_tries} must be ≥ 0")
        if not 0 <= self.overlong_buffer_length <= self.max_completion_length:
            bad(f"overlong_buffer_length={self.overlong_buffer_length} must lie in [0, max_completion_length="
                f"{self.max_completion_length}]")
        if self.rm_loss not in ("pointwise", "pairwise") or self.rm_buffer_policy not in ("fifo", "reservoir"):
            bad(f"rm_loss={self.rm_loss!r} / rm_buffer_policy={self.rm_buffer_policy!r}: choose pointwise or pairwise / "
                "fifo or reservoir")
        if not 0 <= self.rm_replay_ratio < 1 or not 0 < self.rm_label_fraction <= 1:
            bad(f"rm_replay_ratio={self.rm_replay_ratio} must lie in [0, 1) and rm_label_fraction="
                f"{self.rm_label_fraction} in (0, 1]")
        for name in ("rm_buffer_size", "rm_batch_size", "rm_max_length"):
            if getattr(self, name) < 1:
                bad(f"{name}={getattr(self, name)} must be at least 1")
        if self.rm_updates_per_step < 0 or self.rm_train_steps < 0 or self.rm_learning_rate <= 0:
            bad("rm_updates_per_step and rm_train_steps must be ≥ 0 and rm_learning_rate > 0")
        if self.rm_scorer not in ("head", "likelihood") or self.rm_warmup_batches < 0 or self.rm_warmup_updates < 0:
            bad(f"rm_scorer={self.rm_scorer!r} must be head or likelihood; rm_warmup_batches / rm_warmup_updates ≥ 0")
        if self.rm_head_learning_rate is not None and self.rm_head_learning_rate <= 0:
            bad(f"rm_head_learning_rate={self.rm_head_learning_rate} must be > 0")
        if self.curriculum is not None:
            from .curriculum import parse_curriculum

            self.curriculum = parse_curriculum(self.curriculum)
        if self.reward_weights is not None and self.reward_funcs is not None and len(self.reward_weights) != len(self.reward_funcs):
            bad(f"{len(self.reward_weights)} reward_weights for {len(self.reward_funcs)} reward_funcs; give one weight per function")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- parsing from the command line and YAML -------------------------------------------------

def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(GRPOConfig)}


def _convert(name: str, raw, annotation) -> object:
    """Turn a string (CLI) or YAML value into the field's type, or a one-line error."""
    if name == "curriculum":  # a list of stage mappings, or the compact TASK:STEPS,… string
        from .curriculum import parse_curriculum

        return parse_curriculum(raw)
    if name == "gradient_checkpointing_layers" and str(raw).strip().lower() == "auto":
        return "auto"
    hint = typing.get_type_hints(GRPOConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    base = args[0] if args else hint
    if raw is None or (optional and isinstance(raw, str) and raw.lower() in ("none", "null")):
        if optional:
            return None
        raise CohortError(f"--{name} needs a value")
    origin = typing.get_origin(base)
    try:
        if origin is list:
            (item,) = typing.get_args(base)
            items = raw if isinstance(raw, list) else [x for x in str(raw).split(",") if x.strip()]
            return [item(x) if not isinstance(x, item) else x for x in items]
        if base is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        return base(raw)
    except (TypeError, ValueError):
        kind = getattr(base, "__name__", str(base))
        raise CohortError(f"--{name} expects {kind}, got {raw!r}") from None


def _unknown(key: str, source: str) -> CohortError:
    close = difflib.get_close_matches(key, list(_fields()), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return CohortError(f"unknown option {key!r} in {source}{hint}; see `cohort train --help`")


def load_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise CohortError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise CohortError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise CohortError(f"config file {path} must be a mapping of option: value")
    return data


def option_pairs(argv: list[str], command: str = ""):
    """Yield (name, value) for `--name value` / `--name=value` / bare `--name` (value None) arguments,
    dashes in names read as underscores; anything else is a one-line `CohortError`. Shared by
    `cohort train` (`parse_config`) and `cohort eval` / `cohort sft` (`eval_cli.parse_options`)."""
    prefix = f"cohort {command}: " if command else ""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise CohortError(f"{prefix}unexpected argument {arg!r}; options look like --name value")
        key, has_inline, inline = arg[2:].partition("=")
        value = None
        if has_inline:
            value = inline
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        yield key.replace("-", "_"), value
        i += 1


def parse_config(argv: list[str], defaults: dict | None = None) -> GRPOConfig:
    """`--field value` / `--field=value` / `--flag` pairs (and `--config file.yaml`) → GRPOConfig."""
    fields = _fields()
    values: dict = dict(defaults or {})
    cli = {key: "true" if value is None else value for key, value in option_pairs(argv)}  # bare flag = true
    if "config" in cli:
        for key, value in load_yaml(cli.pop("config")).items():
            key = str(key).replace("-", "_")
            if key not in fields:
                raise _unknown(key, "the YAML config")
            values[key] = _convert(key, value, fields[key].type)
    for key, value in cli.items():
        if key not in fields:
            raise _unknown(key, "the command line")
        values[key] = _convert(key, value, fields[key].type)
    return GRPOConfig(**values).validate()


def config_help() -> str:
    lines = []
    for f in dataclasses.fields(GRPOConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        lines.append(f"  --{f.name:<30} (default: {default})")
    return "\n".join(lines)


field = field  # re-exported for users subclassing GRPOConfig
