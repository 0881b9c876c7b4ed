"""A run's assembly: the stages of Algorithm 1 and the objects around them, built once from the
trainer's arguments and returned together as a `RunAssembly`, which `GRPOTrainer` keeps.

The order is the point of this module. The output folder is checked and the ranks joined before
anything heavy (the start-up a sampling rank shares, cohort_grpo/run/start.py); a run that cannot fit is
refused, and its rows read, before its weights load; the configuration is resolved (and frozen) once
the model and the rows exist, and every stage after that is built from the resolved one; checkpointed
layers are set before the model is wrapped, since FSDP2's sharded copy must recompute them too; the
step report, which owns the display, comes last, and the rollout source, which times its phases on it,
after it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from cohort_grpo.tasks.curriculum import Curriculum
from cohort_grpo.algorithm.loss_spec import LossSpec
from cohort_grpo.tasks.prompts import PromptStream
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.plans.capacity import check_capacity
from cohort_grpo.memory.checkpointed_layers import AutoCheckpointing
from cohort_grpo.memory.manager import MemoryManager
from cohort_grpo.optim.precision import cpu_precision_line
from cohort_grpo.optim.optimizer import make_optimizer, optimizer_line
from cohort_grpo.parallel.placement import Placement, launched_rank, launched_world_size
from cohort_grpo.models.lora import has_lora
from cohort_grpo.models.policy import frozen_copy
from cohort_grpo.config.step_counts import epoch_options, with_step_counts
from cohort_grpo.rewards.model import resolve_reward_funcs
from cohort_grpo.rewards.runner import RewardRunner
from cohort_grpo.rollout.layout import Layout
from cohort_grpo.plans.placement_lines import placement_line
from cohort_grpo.rollout.group_sampler import GroupSampler
from cohort_grpo.rollout.sampler import Sampler
from cohort_grpo.rollout.setup import build_rollouts, rollout_source
from cohort_grpo.rollout.source import RolloutSource
from cohort_grpo.tasks.data import dataset_rows, row_origins
from cohort_grpo.telemetry.step_report import StepReport, open_step_report
from cohort_grpo.tools.environments import environment_reward
from cohort_grpo.tools.toolbox import Toolbox
from cohort_grpo.update.fast_path import fast_path_line
from cohort_grpo.update.logprobs import takes_attention_rows
from cohort_grpo.update.policy_update import PolicyUpdate, sampler_correction_mode
from cohort_grpo.update.schedule import lr_scheduler
from cohort_grpo.parallel.colocation import colocate
from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.parallel.engine_copy import EngineCopy
from cohort_grpo.run.lifecycle import check_output_dir
from cohort_grpo.run.start import RankStart, start_rank
from cohort_grpo.run.teacher import teacher_given, teacher_policy
from cohort_grpo.update.teacher import TeacherPolicy


@dataclass
class RunAssembly:
    """The parts of a run, as `assemble_run` built them.

    args: the run's resolved, frozen configuration. model: π_θ as the engine samples and the run saves it:
    the loaded policy, or the FSDP2 module itself where no rank keeps a whole copy (colocated sampling) or
    the whole copy is empty between a rollout and its refresh. train_model: what the training forward
    calls (the model, DDP around it, or FSDP2's sharded copy). ref_model: π_ref's frozen copy, None when
    β = 0 or with LoRA (π_ref is the policy with its adapters off). placement: which ranks train and sample, on
    which copy (its split settled). layout: how the passes over a rollout lay it out (the G completions of a
    prompt sharing its forward, or a padded row each). sampler_correction: the correction in force for a sampler that is not the
    policy being trained, None when off. sampler, group_sampler: this rank's engine over the policy and
    Algorithm 1's sampling stage over it (held-out evaluation samples with them); rollouts: where each step's
    rollout comes from; engine_copy: under FSDP2, the engine's copy of the weights (a checkpoint's load
    refreshes it), else None. teacher: on-policy distillation's π_teacher stage, None without a teacher."""

    args: GRPOConfig
    parallel: Parallel
    placement: Placement
    device: torch.device
    model: nn.Module
    tokenizer: Any
    pad_id: int
    train_rows: list[dict]
    eval_rows: list[dict] | None
    curriculum: Curriculum | None
    rewards: RewardRunner
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    uses_reference: bool
    ref_model: nn.Module | None
    layout: Layout
    sampler: Sampler
    group_sampler: GroupSampler
    rollouts: RolloutSource
    engine_copy: EngineCopy | None
    memory: MemoryManager
    prompts: PromptStream
    sampler_correction: str | None
    loss_spec: LossSpec
    policy_update: PolicyUpdate
    report: StepReport
    teacher: TeacherPolicy | None = None


def assemble_run(model, args: GRPOConfig, *, reward_funcs, train_dataset, eval_dataset, processing_class, task,
                 toolbox: Toolbox | None, peft_config, sampler_factory, next_prompts: Callable[[], list[dict]],
                 log: Callable[[str], None], stage_log: Callable[[str], None], teacher_model=None,
                 reward_processing_classes=None) -> RunAssembly:
    """The run `args` (validated, not yet resolved) describes, from `GRPOTrainer`'s arguments (TRL's names).

    next_prompts(): this rank's block of the next prompt batch, which the rollouts draw (the trainer's own: a
    curriculum switches its stages there). log: where lines go until the display exists (the returned report's
    `log` after). stage_log: what the memory manager and the policy update log through for the whole run; the
    trainer passes its own, which reaches the display once the trainer has it. teacher_model: a distillation
    teacher given as an argument (a model object, or a name) rather than in the config. reward_processing_classes:
    TRL's, the tokenizer each reward model reads (None: its own, else the policy's)."""
    # Which ranks train and sample, and on which copy: decided once, before anything starts (parallel/placement.py).
    placement = Placement.from_config(args, launched_world_size())
    if placement.samples_here(launched_rank()):
        raise CohortError(f"GRPOTrainer on a rank that only samples (rollout_gpus={args.rollout_gpus}: the last "
                          "ranks): run cohort_grpo.SamplingRank(model, args).serve() there instead "
                          "(cohort_grpo.is_sampling_rank(args) tells the ranks apart)")
    check_output_dir(args)  # a writable folder (an earlier run there is train()'s to continue or replace)
    teacher = teacher_given(teacher_model, args)  # with distillation_coef, before anything loads
    asked_split = args.rollout_tensor_parallel_size  # the log says whether auto chose it
    train_rows: list[dict] = []

    def before_loading(args: GRPOConfig, parallel: Parallel) -> GRPOConfig:
        nonlocal train_rows
        if args.device == "auto" and parallel.device.type == "cpu" and torch.cuda.is_available():
            log("device: cpu, the built-in tiny model's step is faster there than on a GPU (--device cuda to use it)")
        plan = check_capacity(model, args, placement, parallel.device)  # refused before loading: what would fit
        if args.offload_optimizer == "auto" and plan is not None:  # the plan's choice: host memory where only it fits
            args = replace(args, offload_optimizer=plan.step.offload_optimizer)
        train_rows = training_rows(train_dataset, args, toolbox, parallel.world_size)
        # TRL's epochs, strategies and fractions of the run: whole step counts, before the config is frozen.
        return with_step_counts(args, len(train_rows), parallel.world_size)

    start = start_rank(model, args, processing_class, placement=placement, toolbox=toolbox, peft_config=peft_config,
                       log=log, before_loading=before_loading)
    args, parallel, device, tokenizer = start.args, start.parallel, start.device, start.tokenizer
    curriculum, rewards = build_rewards(args, reward_funcs, task, tokenizer, device, toolbox, reward_processing_classes)
    eval_rows = dataset_rows(eval_dataset, "eval_dataset") if eval_dataset is not None else None
    provided = {"environments"} if toolbox is not None and toolbox.environment_factory else set()
    check_reward_columns(rewards, train_rows, provided, row_origins(args, train_rows))
    train_model, optimizer, scheduler, auto_checkpointing, engine_copy = build_training(start)
    model, sampling_model, ref_model = place_policy(start, train_model, engine_copy)
    # The G completions of a prompt share its forward in the log-prob passes and the update: models that take
    # attention rows (no linear-attention state; a vision-language model's images go in once per prompt), and
    # only where a prompt has several completions.
    layout = Layout.choose(args.share_prompt_prefix, args.num_generations, takes_attention_rows(model))
    group = parallel.sampling_group
    rollouts = build_rollouts(args, sampling_model, tokenizer, start.pad_id, toolbox, placement=start.placement,
                              link=parallel.link, rank=parallel.rank, sampler_factory=sampler_factory,
                              sampling_group=None if group is None else group.process_group)
    memory = MemoryManager(args, placement=start.placement, auto_checkpointing=auto_checkpointing, ref_model=ref_model,
                           sampler=rollouts.sampler, device=device, layout=layout, log=stage_log,
                           release_weights=None if engine_copy is None else engine_copy.release)
    prompts = PromptStream(train_rows, args.prompts_per_step * parallel.world_size, args.seed)
    # The engine's bf16 kernels are not the trainer's: weigh each sample by π_trainer / π_sampler.
    sampler_correction = sampler_correction_mode(args, model, device)
    loss_spec = LossSpec.from_config(args, sampler_correction)  # the loss's settings, in one value
    policy_update = PolicyUpdate(args, train_model=train_model, optimizer=optimizer, scheduler=scheduler,
                                 memory=memory, parallel=parallel, device=device, pad_id=start.pad_id,
                                 layout=layout, loss=loss_spec, log=stage_log)
    distillation = teacher_policy(teacher, args, tokenizer=tokenizer, device=device, policy=model,
                                  logprobs=policy_update.logprobs, log=stage_log)
    report = open_report(args, model, optimizer, toolbox, parallel, start.placement, asked_split, log)
    source = rollout_source(rollouts, memory=memory, phases=report, next_rows=next_prompts,
                            next_seed=prompts.next_seed, engine_copy=engine_copy, policy=model, parallel=parallel,
                            max_steps=args.max_steps, past_end=args.save_strategy != "no", log=stage_log)
    return RunAssembly(args=args, parallel=parallel, placement=start.placement, device=device, model=model, tokenizer=tokenizer,
                       pad_id=start.pad_id, train_rows=train_rows, eval_rows=eval_rows, curriculum=curriculum,
                       rewards=rewards, train_model=train_model, optimizer=optimizer, scheduler=scheduler,
                       uses_reference=args.beta > 0, ref_model=ref_model, layout=layout,
                       sampler=rollouts.sampler, group_sampler=rollouts.group_sampler, rollouts=source,
                       engine_copy=engine_copy, memory=memory, prompts=prompts, sampler_correction=sampler_correction,
                       loss_spec=loss_spec, policy_update=policy_update, report=report, teacher=distillation)


def build_rewards(args: GRPOConfig, reward_funcs, task, tokenizer, device: torch.device,
                  toolbox: Toolbox | None, processing_classes=None) -> tuple[Curriculum | None, RewardRunner]:
    """The curriculum (its stages switch the prompt source and, unless reward_funcs are given, the rewards) and
    the run's `RewardRunner`: the reward functions asked for, and an environment's get_reward() beside them."""
    curriculum = Curriculum.from_config(args, keep_rewards=reward_funcs is not None or bool(args.reward_funcs))
    env_reward = environment_reward(toolbox.environment_factory) if toolbox is not None else None
    if env_reward is not None and reward_funcs is None and not args.reward_funcs and task is None:
        funcs, weights = [], None  # TRL: an environment's get_reward() may be the whole reward
    else:
        funcs, weights = resolve_reward_funcs(reward_funcs, args, task, tokenizer, device, processing_classes)
    if env_reward is not None:  # the environment's get_reward(): one more reward, weight 1 (TRL)
        funcs, weights = funcs + [env_reward], None if weights is None else list(weights) + [1.0]
    return curriculum, RewardRunner(funcs, weights, timeout_s=args.reward_timeout, errors=args.reward_errors,
                                    none_ok=args.distillation_coef > 0)  # a teacher's signal alone: pure distillation


def build_training(start: RankStart):
    """(train_model, optimizer, scheduler, auto_checkpointing, engine_copy): what trains the policy. The model is
    compiled and its checkpointed layers set before it is wrapped (FSDP's sharded copy must recompute them too);
    under FSDP2 the loaded model stays the engine's copy, refreshed from the sharded one (`EngineCopy`)."""
    model, args, parallel = start.model, start.args, start.parallel
    if args.torch_compile and hasattr(model, "compile_for_training"):
        model.compile_for_training()  # fused elementwise work, fewer saved activations
    auto_checkpointing = AutoCheckpointing.setup(model, args, start.device) if args.gradient_checkpointing else None
    # What the training forward calls: the model itself, DDP around it on several ranks, or with
    # --fsdp a sharded copy (`model` then stays the full copy the engine samples and saves).
    train_model = parallel.wrap(model, fsdp=args.fsdp)
    engine_copy = EngineCopy(model, train_model) if parallel.fsdp else None
    # bf16 weights on a GPU: the optimizer keeps fp32 masters and moments (cohort_grpo/optim/precision.py).
    optimizer = make_optimizer(train_model, args)
    return train_model, optimizer, lr_scheduler(optimizer, args), auto_checkpointing, engine_copy


def place_policy(start: RankStart, train_model: nn.Module, engine_copy: EngineCopy | None):
    """(π_θ as the run samples and saves it, what the engine samples, π_ref or None). β = 0 needs no reference at
    all: no copy and no forward passes for it."""
    model, args, parallel = start.model, start.args, start.parallel
    uses_reference = args.beta > 0
    sampling_model = model
    if start.placement.colocated:  # FSDP2 ranks sampling in tensor-parallel groups: no rank keeps a whole copy
        sampling_model, ref_model = colocate(parallel, engine_copy, start.placement, args.ddp_timeout, uses_reference)
        model = train_model  # π_θ is the FSDP2 module itself (π_old's pass, saving, callbacks)
    else:
        ref_model = frozen_copy(model) if uses_reference and not has_lora(model) else None
        if parallel.fsdp and start.placement.engine_released_in_update:  # the plain copy is empty between a
            model = train_model  # rollout and its refresh: π_old's pass goes through FSDP2
    return model, sampling_model, ref_model


def open_report(args: GRPOConfig, model: nn.Module, optimizer, toolbox: Toolbox | None, parallel: Parallel,
                placement: Placement, asked_split, log: Callable[[str], None]) -> StepReport:
    """The step report, which owns the display, opened last; the tools saved beside the run's outputs first."""
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if parallel.is_main and toolbox is not None:  # rank 0 alone logs, prints and saves
        for warning in toolbox.save(args.output_dir):  # `cohort-grpo chat` on the model offers the same tools
            log(warning)
    # The display's first lines, worked out before the report opens its files: a failure here leaves none open.
    device = parallel.device
    lines = [fast_path_line(args), optimizer_line(optimizer)] if device.type == "cuda" else []
    lines += [placement_line(args, placement, asked_split, device), cpu_precision_line(args.dtype, device)]
    report = open_step_report(args, model=model, device=device, parallel=parallel, log=log)
    for line in filter(None, lines):
        report.log(line)
    return report


def check_reward_columns(rewards, rows: list[dict], provided: set[str], origins: Callable[[int], str]) -> None:
    """Every training row has the columns the reward functions need, found before step 1 (rows given as dicts may
    differ: a row without one would fail its step). `provided`: columns the run adds itself; `origins(i)`: row i's
    place, for the message."""
    rewards.check_columns(set(rows[0]) | provided)
    needs = {column: name for name, func in zip(rewards.names, rewards.funcs)
             for column in rewards.required_columns(func) if column not in provided}
    for index, row in enumerate(rows):
        missing = next((column for column in needs if column not in row), None)
        if missing is not None:
            raise CohortError(f"{origins(index)} has no {missing!r} column, which reward {needs[missing]!r} needs "
                              f"(its columns: {sorted(row)}); add it to every row, or drop the reward")


def training_rows(train_dataset, args: GRPOConfig, toolbox: Toolbox | None, world_size: int) -> list[dict]:
    """The rows prompts are drawn from. Without a train_dataset, an environment that writes the prompt in
    its reset() (TRL) is driven by one step's worth of empty user turns that reset() fills in."""
    if train_dataset is None and toolbox is not None and toolbox.environment_factory is not None:
        if epoch_options(args):
            given, instead = epoch_options(args)[0]
            raise CohortError(f"{given} counts passes over a train_dataset, and there is none (the environment "
                              f"writes the prompts); {instead}")
        return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(args.prompts_per_step * world_size)]
    return dataset_rows(train_dataset, "train_dataset")
