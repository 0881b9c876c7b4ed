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

from .algo import LOSS_TYPES, SCALE_CHOICES
from .errors import CohortError


@dataclass
class GRPOConfig:
    # What to train, on what.
    model: str | None = None  # local HF folder, hub id or .gguf; None → the built-in tiny model
    task: str = "arithmetic"
    data_files: str | None = None  # local JSONL/parquet for the task (e.g. GSM8K)
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
    seed: int = 42
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16

    # Book-keeping.
    logging_steps: int = 1
    log_completions_steps: int = 10  # sample completions to completions.jsonl every N steps
    save_steps: int = 0  # 0 → only at the end
    eval_steps: int = 0  # 0 → only before and after
    eval_limit: int = 200  # held-out problems for accuracy
    report_to: str = "none"
    quiet: bool = False

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
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad(f"unknown dtype {self.dtype!r}; choose auto, float32 or bfloat16")
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


def parse_config(argv: list[str], defaults: dict | None = None) -> GRPOConfig:
    """`--field value` / `--field=value` / `--flag` pairs (and `--config file.yaml`) → GRPOConfig."""
    fields = _fields()
    values: dict = dict(defaults or {})
    cli: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise CohortError(f"unexpected argument {arg!r}; options look like --name value")
        key, _, inline = arg[2:].partition("=")
        key = key.replace("-", "_")
        if inline or "=" in arg:
            value = inline
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        else:
            value = "true"  # a bare flag
        cli[key] = value
        i += 1
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
