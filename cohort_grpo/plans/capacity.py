"""A run that cannot fit its GPUs is refused before its weights load, with what would fit.

`check_capacity` reads the model's shape without its weights (a folder's config.json, a GGUF file's metadata,
a hub id's config.json alone), plans a training rank's step (`training_plan.py`) and compares the busiest
phase with the GPU's free memory (`torch.cuda.mem_get_info`). Where the plan is larger it raises one line:
what the run needs and has, and the nearest runs that fit — AdamW's state in host memory, FSDP2 over more GPUs,
LoRA, or a smaller step. With `offload_optimizer=auto` a one-GPU full-parameter step whose state and whole engine
(every completion decoded at once) do not fit the GPU keeps AdamW's state in host memory where the host has it
free (the returned plan's `step.offload_optimizer`): the state's copies cost about a second a step, an engine
decoding a fraction of the step at a time far more.

Only on CUDA, and only for cohort's own model families given by name: on the CPU memory is rarely what
stops a run, a model object is already loaded, and a transformers model's memory is not this plan's. The
plan leaves out a few hundred MiB (the CUDA context, NCCL's and the graphs' buffers), so it is compared with
the whole free memory: a refused run would have run out of memory, while a run close to the line may still.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.config import ModelConfig, is_supported
from cohort_grpo.models.loading import hub_offline, is_hub_id
from cohort_grpo.optim.host_state import holds_split_masters
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.sampling_plan import parameter_count
from cohort_grpo.plans.training_plan import GIB, MemoryPlan, RankShape, StepShape, offloaded, training_memory_plan

MOST_GPUS = 64  # the largest FSDP2 group the refusal suggests


def config_before_loading(model) -> ModelConfig | None:
    """The shape of the model `model` names, read without its weights; None where there is nothing to read
    (the built-in model, a model object, a family cohort does not implement, a hub id it cannot reach)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    spec = str(model)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return _hf_config(path / "config.json")
        ggufs = sorted(path.glob("*.gguf"))
        return _gguf_config(ggufs[0]) if len(ggufs) == 1 else None
    if path.is_file():
        return _gguf_config(path) if path.suffix == ".gguf" else None
    if is_hub_id(spec):
        return _hub_config(spec)
    return None


def _hf_config(file: Path) -> ModelConfig | None:
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError):
        return None  # the loader says what is wrong with the file
    return ModelConfig.from_hf_dict(fields) if is_supported(fields) else None


def _gguf_config(file: Path) -> ModelConfig | None:
    try:
        import gguf

        from cohort_grpo.models.gguf import read_config

        reader = gguf.GGUFReader(str(file))  # memory-maps the file: the metadata is read, not the tensors
        return read_config(reader, has_output_weight=any(t.name == "output.weight" for t in reader.tensors))
    except Exception:  # noqa: BLE001 - an unreadable or unsupported file: the loader's error says so
        return None


def _hub_config(repo_id: str) -> ModelConfig | None:
    """The hub model's config.json alone: from the cache, else downloaded (a few KB) when the hub is online."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json")
        if isinstance(cached, str):
            return _hf_config(Path(cached))
        if hub_offline():
            return None
        return _hf_config(Path(hf_hub_download(repo_id, "config.json")))
    except Exception:  # noqa: BLE001 - unreachable or unknown: the loader reports it
        return None


def fitting_alternatives(config: ModelConfig, step: StepShape, rank: RankShape, free: int) -> list[str]:
    """The nearest runs whose plan fits `free` bytes a GPU, as flags: more GPUs under FSDP2, LoRA, a smaller step."""
    fits = lambda s, p: training_memory_plan(config, s, p).peak <= free  # noqa: E731
    out = []
    host = training_memory_plan(config, replace(step, offload_optimizer=True), rank)
    if not step.offload_optimizer and offloaded(host.step, rank) and host.peak <= free and host_holds(host):
        out.append("AdamW's state in host memory (--offload_optimizer true)")
    for ranks in range(rank.ranks + 1, MOST_GPUS + 1):
        wider = replace(rank, ranks=ranks, fsdp=True,
                        sampling_split=ranks if rank.samples else rank.sampling_split)
        if fits(step, wider):
            out.append(f"{ranks} GPUs with FSDP2 (--fsdp true under --nproc_per_node {ranks})")
            break
    if not step.lora_rank and fits(replace(step, lora_rank=16, reference=False), rank):
        out.append("LoRA (--use_peft true)")
    smaller = smaller_step(config, step, rank, free)
    if smaller:
        out.append(f"a smaller step ({smaller})")
    return out


def smaller_step(config: ModelConfig, step: StepShape, rank: RankShape, free: int) -> str | None:
    """Flags of the first smaller step that fits: one completion a micro-batch, then the KV cache released for
    the update, then fewer completions a GPU (down to one group), then shorter completions (down to 256)."""
    changes: dict = {}
    candidates = []
    if step.micro_rows > 1:
        changes["micro_rows"] = 1
        candidates.append(dict(changes))
    if not step.free_sampling_memory:
        changes["free_sampling_memory"] = True
        candidates.append(dict(changes))
    rows, length = step.rows, step.completion_len
    while rows > step.group or length > 256:
        if rows > step.group:
            rows = max(step.group, rows // 2)
        else:
            length //= 2
        candidates.append(dict(changes, rows=rows, completion_len=length))
    for candidate in candidates:
        smaller = replace(step, **candidate)
        if training_memory_plan(config, smaller, rank).peak > free:
            continue
        flags = []
        if smaller.micro_rows != step.micro_rows:
            flags.append(f"--per_device_train_batch_size {smaller.micro_rows}")
        if smaller.micro_rows != step.micro_rows or smaller.rows != step.rows:
            flags.append(f"--gradient_accumulation_steps {smaller.rows // smaller.micro_rows}")
        if smaller.free_sampling_memory != step.free_sampling_memory:
            flags.append("--free_sampling_memory true")
        if smaller.completion_len != step.completion_len:
            flags.append(f"--max_completion_length {smaller.completion_len}")
        return " ".join(flags)
    return None


def teacher_bytes(args) -> int:
    """The weights of the distillation teacher `args` names, in the dtype it loads in (teacher_model_init_kwargs',
    else the run's weights': 2 bytes a parameter on a GPU, 4 in float32); 0 without one, or where its shape cannot
    be read before loading."""
    teacher = config_before_loading(args.teacher_model) if args.teacher_model is not None else None
    if teacher is None:
        return 0
    kwargs = args.teacher_model_init_kwargs or {}
    dtype = str(kwargs.get("dtype") or kwargs.get("torch_dtype") or "auto").removeprefix("torch.")
    return parameter_count(teacher) * (4 if (args.dtype if dtype == "auto" else dtype) == "float32" else 2)


def check_capacity(model, args, placement: Placement, device: torch.device) -> MemoryPlan | None:
    """Refuse, before loading, a run of `model` with `args` (validated) placed by `placement` whose step cannot
    fit the free memory of `device`; the plan where it fits, None where there is nothing to plan."""
    if device.type != "cuda":
        return None
    config = config_before_loading(model)
    if config is None:
        return None
    step = replace(StepShape.from_config(args, placement), teacher_bytes=teacher_bytes(args))
    whole_engine = step  # every completion of the step decoded at once (up to the engine's slots)
    if args.max_concurrent_sequences == "auto":  # sized after loading to what the step leaves: one slot will do
        step = replace(step, engine_slots=1)
    rank = RankShape.of(placement)
    plan = training_memory_plan(config, step, rank)
    free, _total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # this process's cached blocks
    if (args.offload_optimizer == "auto" and holds_split_masters(step.dtype)
            and offload_pays(config, whole_engine, rank, free)):
        plan = training_memory_plan(config, replace(step, offload_optimizer=True), rank)
    if plan.peak <= free:
        check_host_memory(model, plan)
        return plan
    options = fitting_alternatives(config, step, rank, free)
    how = "LoRA" if step.lora_rank else "full-parameter"
    ranks = placement.trainers
    where = f"FSDP2 over {ranks} GPUs" if rank.sharded else (f"{ranks} GPUs" if ranks > 1 else "one GPU")
    raise CohortError(
        f"{model}: {how} GRPO of this {plan.parameters / 1e9:.1f}B-parameter {config.model_type} model on {where} "
        f"needs about {plan.peak / GIB:.1f} GiB a GPU ({plan.describe()}), more than the {free / GIB:.1f} GiB free "
        f"on {device}; what would fit: {'; or '.join(options) or 'nothing this plan can find (more GPUs, LoRA)'}")


def offload_pays(config: ModelConfig, whole_engine: StepShape, rank: RankShape, budget: int) -> bool:
    """`offload_optimizer=auto`'s rule: AdamW's state goes to the host where the GPU's `budget` bytes cannot keep it
    beside an engine decoding the whole step at once (`whole_engine`), and can hold the step without it (one
    slot at least), and the host has the memory. Its copies cost about a second a step; an engine decoding a
    fraction of the step at a time costs far more."""
    if training_memory_plan(config, whole_engine, rank).peak <= budget:
        return False
    host = training_memory_plan(config, replace(whole_engine, engine_slots=1, offload_optimizer=True), rank)
    return offloaded(host.step, rank) and host.peak <= budget and host_holds(host)


def host_memory_available() -> int:
    """Bytes of host memory the kernel says a process can still take without swapping (MemAvailable); a very large
    number where it cannot be read (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def host_holds(plan: MemoryPlan) -> bool:
    """Whether what `plan` keeps in host memory fits the host's available memory."""
    return sum(plan.host.values()) <= host_memory_available()


def check_host_memory(model, plan: MemoryPlan) -> None:
    """Refuse, before loading, a run whose optimizer state in host memory cannot fit the host's available memory."""
    if "optimizer state" not in plan.host or host_holds(plan):
        return
    need, available = sum(plan.host.values()), host_memory_available()
    parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in plan.host.items())
    raise CohortError(f"{model}: offload_optimizer keeps {need / GIB:.1f} GiB in host memory ({parts}), more than "
                      f"the {available / GIB:.1f} GiB available on this machine; pass --offload_optimizer false "
                      "with more GPU memory, or free host memory")
