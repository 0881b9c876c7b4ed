"""Training metrics on disk: `metrics.jsonl`, `completions.jsonl`, and optional TensorBoard / W&B.

`metrics.jsonl` holds one JSON object per logged step, `{"step": int, "time": float, <name>: float, ...}`
(docs/architecture.md, "Metrics"), with `"warnings": [str, ...]` on a line after a learning-health check
fired (cohort_grpo/telemetry/health.py). Metric names follow TRL's `GRPOTrainer` where TRL has one
(`reward`, `reward_std`, `rewards/<func>/mean`, `kl`, `entropy`, `clip_ratio/low_mean`,
`completions/mean_length`, ...), so plots and habits carry over between the two.

Every line is flushed as soon as it is written: a run killed mid-way (Ctrl-C, OOM, preemption) keeps
every step it logged, and `read_metrics` drops a half-written last line instead of failing.
JSON has no NaN or infinity, so non-finite values are written as `null`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from cohort_grpo.config.choices import choose
from cohort_grpo.errors import CohortError

if TYPE_CHECKING:  # for the annotation only: the HTML report (report.py) imports this module without torch
    from cohort_grpo.rollout.layout import Layout

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"


def _json_value(value: Any) -> Any:
    """A JSON-safe copy of `value`: tensors / numpy scalars become Python numbers, NaN/inf become None."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # torch / numpy scalar
        value = value.item()
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


def parse_report_to(report_to: list[str] | tuple[str, ...] | str | None) -> set[str]:
    """TRL-style `report_to`: "none", "all", one name, a comma-separated string or a list of names."""
    if report_to is None:
        return set()
    choose("report_to", report_to)  # GRPOConfig's own check, for a logger built from Python directly
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = {name.strip() for name in names if name and name.strip()}
    if "all" in names:
        return {"tensorboard", "wandb"}
    return names - {"none"}


def _wandb_is_configured(wandb: Any) -> bool:
    """True when W&B can log without prompting: an API key, a saved login, or offline/disabled mode."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return True
    try:
        return bool(wandb.api.api_key)  # set by `wandb login` (~/.netrc)
    except Exception:  # noqa: BLE001 - any failure here just means "not logged in"
        return False


class MetricsLogger:
    """Appends metrics to `<output_dir>/metrics.jsonl` (always) and to TensorBoard / W&B when asked.

    `report_to` takes TRL's values ("none", "tensorboard", "wandb", "all", or a list). A backend named
    explicitly that is not installed (or, for W&B, not logged in) is a `CohortError` before training
    starts, naming the fix; "all" means "those that are available" and skips the others with a
    one-line notice. The JSONL files are always written, so `cohort-grpo report` works without either.
    """

    def __init__(
        self,
        output_dir: str | Path,
        report_to: list[str] | str = "none",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name or self.output_dir.name
        self.notices: list[str] = []
        self._metrics_file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")
        self._completions_file = None
        self._tensorboard = None
        self._wandb_run = None
        reporters = parse_report_to(report_to)
        names = report_to.split(",") if isinstance(report_to, str) else list(report_to or [])
        self._strict = "all" not in {str(name).strip().lower() for name in names}
        if "tensorboard" in reporters:
            self._tensorboard = self._open_tensorboard()
        if "wandb" in reporters:
            self._wandb_run = self._open_wandb(config)

    def _unavailable(self, message: str) -> None:
        """A requested backend cannot be used: an error when it was named, a notice under "all"."""
        if self._strict:
            self._metrics_file.close()
            raise CohortError(f"report_to asks for {message}")
        self._notice(f"report_to=all: skipping {message}")

    def _notice(self, message: str) -> None:
        self.notices.append(message)
        print(f"cohort: {message}", file=sys.stderr, flush=True)

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self._unavailable("tensorboard, which is not installed: `pip install tensorboard`, or drop it from report_to")
            return None
        return SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    def _open_wandb(self, config: dict[str, Any] | None):
        try:
            import wandb
        except ImportError:
            self._unavailable("wandb, which is not installed: `pip install wandb` and `wandb login`, or drop it from report_to")
            return None
        if not _wandb_is_configured(wandb):
            self._unavailable("wandb, which is not logged in: set WANDB_API_KEY, run `wandb login` or set "
                              "WANDB_MODE=offline")
            return None
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT", "cohort"),
            name=self.run_name,
            dir=str(self.output_dir),
            config=_json_value(config or {}),
        )

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Append one line `{"step", "time", **metrics}` and flush it; returns the record as written."""
        record = {"step": int(step), "time": time.time()}
        record.update({str(name): _json_value(value) for name, value in metrics.items()})
        if self._metrics_file.closed:  # after the run (trainer.evaluate() once train() returned): append again
            self._metrics_file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")
        self._metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics_file.flush()
        numbers = {
            name: value
            for name, value in record.items()
            if name not in ("step", "time") and isinstance(value, (int, float))
            and not isinstance(value, bool)
        }
        if self._tensorboard is not None:
            for name, value in numbers.items():
                self._tensorboard.add_scalar(name, value, global_step=record["step"])
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(numbers, step=record["step"])
        return record

    def log_completions(self, step: int, rows: Iterable[dict[str, Any]]) -> None:
        """Append sampled completions, one line each: `{"step", "prompt", "completion", "rewards", "advantage"}`.

        `rewards` maps each reward function's name to its score (None where it did not score the sample).
        """
        if self._completions_file is None:
            self._completions_file = open(self.output_dir / COMPLETIONS_FILE, "a", encoding="utf-8")
        lines = [
            json.dumps({"step": int(step), **_json_value(dict(row))}, ensure_ascii=False, allow_nan=False)
            for row in rows
        ]
        if lines:
            self._completions_file.write("\n".join(lines) + "\n")
            self._completions_file.flush()

    def close(self) -> None:
        for handle in (self._metrics_file, self._completions_file):
            if handle is not None and not handle.closed:
                handle.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# -- throughput, memory, MFU ----------------------------------------------------------------------

# Dense bf16 tensor-core peak of common training GPUs, in FLOP/s (vendor datasheets, no sparsity).
# Matched by substring of torch.cuda.get_device_name(); the first match wins, so specific names go first.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM / NVL
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
)


def peak_flops(device) -> float | None:
    """The device's dense bf16 peak FLOP/s from `PEAK_BF16_FLOPS`; None on CPU or an unknown GPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def update_flops(model, prompt_tokens: int, completion_tokens: int,
                 attention_pairs: dict[int | None, int] | None = None) -> float:
    """Model FLOPs of one forward + backward over a step's tokens, weight by weight (Kaplan et al.
    2020's 2 FLOPs per weight per token forward, 4 backward):

    - the LM head runs only where a completion token is predicted: `completion_tokens` times;
    - the input embedding is a lookup, no FLOPs (a tied one is counted once, as the head);
    - every other weight sees all `prompt_tokens + completion_tokens` the layers compute;
    - a frozen weight (LoRA's base model) takes no weight gradient: 4 FLOPs per token, not 6;
    - a mixture of experts' expert weights see only their routed share of the tokens, k / E
      (`active_share`; the router sees them all);
    - attention's score and value products, as PaLM's MFU counts them (Chowdhery et al. 2022,
      appendix B), but only the causal half that is computed: 2 products × 2 FLOPs × heads ×
      head dim per (query, key) pair forward, twice that backward, over `attention_pairs[window]`
      pairs per layer (Layout.attention_pairs, keyed by the layer's sliding window or None; see
      `attention_layers`). Left out when `attention_pairs` is None or the architecture is unknown.

    With every weight trained, no head or embedding found and no attention term this is 6·N·tokens.
    Recomputation under activation checkpointing is not counted: it is not model work."""
    from cohort_grpo.models.lora import base_model
    from cohort_grpo.models.moe import active_shares

    inner = base_model(model)
    flops = 0.0
    if attention_pairs is not None:
        flops += sum(12 * width * attention_pairs[window] for width, window in attention_layers(inner))
    head = getattr(inner, "lm_head", None)
    head_weight = getattr(head, "weight", None)
    embed = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else \
        getattr(getattr(inner, "model", None), "embed_tokens", None)
    embed_weight = getattr(embed, "weight", None)
    tokens = prompt_tokens + completion_tokens
    shares = active_shares(inner)
    for param in model.parameters():  # a shared (tied) tensor is yielded once
        per_token = (6 if param.requires_grad else 4) * shares.get(id(param), 1.0)
        if param is head_weight:
            flops += per_token * param.numel() * completion_tokens
        elif param is not embed_weight:
            flops += per_token * param.numel() * tokens
    return flops


def attention_layers(model) -> list[tuple[int, int | None]]:
    """(heads × head dim, sliding window or None) of each attention layer of a cohort or supported
    transformers model; [] for an architecture cohort does not know."""
    from cohort_grpo.models.config import ModelConfig, is_supported

    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        hf = config.to_dict() if hasattr(config, "to_dict") else None
        if hf is None or not is_supported(hf):
            return []
        config = ModelConfig.from_hf_dict(hf)
    width = config.num_attention_heads * config.head_dim
    return [(width, config.layer_sliding_window(i)) for i in range(config.num_hidden_layers)]


def rollout_attention_pairs(model, layout: Layout, prompt_ids: list[list[int]], completion_lengths: list[int],
                            max_rows: int, images: list | None = None) -> dict[int | None, int]:
    """`update_flops`'s `attention_pairs` for a rollout laid out as `layout` lays it out (`Layout.attention_pairs`),
    for each sliding window (or None) that `model`'s attention layers use (`images`: each row's prompt images)."""
    windows = dict.fromkeys(window for _, window in attention_layers(model))
    return {window: layout.attention_pairs(prompt_ids, completion_lengths, max_rows, window, images)
            for window in windows}


def peak_memory_gib(device, reset: bool = True) -> float:
    """Peak memory since the last reset, in GiB: CUDA `max_memory_allocated` (then reset, so each
    step reports its own peak); on CPU the process's peak resident set size (ru_maxrss, lifetime)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def throughput_metrics(model, device, phase_seconds: dict[str, float], prompt_tokens: int, completion_tokens: int,
                       num_iterations: int, logprob_passes: int,
                       attention_pairs: dict[int | None, int] | None = None) -> dict[str, float | None]:
    """Tokens per second of each phase, peak memory, and the update's model FLOPs utilisation.

    - `tokens_per_second/sampling`: completion tokens generated per second of sampling;
    - `tokens_per_second/logprobs`: prompt + completion tokens scored per second by the no-grad
      passes (log π_old when μ > 1, log π_ref when β > 0), when there are any;
    - `tokens_per_second/update`: prompt + completion tokens through forward + backward per second,
      counting each of the μ updates;
    `prompt_tokens` are those the forwards compute: a prompt its group shares counts once
    (`Layout.computed_prompt_tokens`).
    - `mfu`: `update_flops` (attention included when `attention_pairs` is given) × the μ updates /
      update seconds / the GPU's peak bf16 FLOP/s; None on CPU.
    """
    tokens = prompt_tokens + completion_tokens
    update_tokens = tokens * num_iterations

    def rate(count: float, phase: str) -> float | None:
        seconds = phase_seconds.get(phase)
        return count / seconds if seconds and seconds > 0 else None

    out: dict[str, float | None] = {
        "tokens_per_second/sampling": rate(completion_tokens, "sampling"),
        "tokens_per_second/update": rate(update_tokens, "update"),
    }
    if logprob_passes:
        out["tokens_per_second/logprobs"] = rate(tokens * logprob_passes, "logprobs")
    peak = peak_flops(device)
    seconds = phase_seconds.get("update")
    flops = update_flops(model, prompt_tokens, completion_tokens, attention_pairs) * num_iterations
    out["mfu"] = flops / seconds / peak if peak and seconds else None
    out["peak_memory_gib"] = peak_memory_gib(device)
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All objects in a JSONL file. A truncated last line (a run killed mid-write) is dropped;
    a broken line anywhere else is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise CohortError(f"{path} does not exist: pass a run directory written by `cohort-grpo train`")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the run was killed while writing this line
                break
            raise CohortError(
                f"{path} line {number} is not valid JSON: the file is corrupt; delete that line"
            ) from None
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl` (or of the file itself when given a file path).

    Values written as null (NaN / inf when logged) come back as None.
    """
    path = Path(run_dir)
    return read_jsonl(path if path.is_file() else path / METRICS_FILE)


def read_completions(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `<run_dir>/completions.jsonl`; an empty list when the run logged none."""
    path = Path(run_dir) / COMPLETIONS_FILE
    return read_jsonl(path) if path.is_file() else []
