"""`GRPOTrainer`: DeepSeekMath Algorithm 1, with the loop in `train()` readable top to bottom.

    for step in 1..max_steps:
        every M steps:        π_ref ← π_θ                            (outer iteration)
        sample a prompt batch
        π_old ← π_θ;  sample G completions per prompt from π_old    (rollout)
        score each completion with the reward functions r_φ          (rewards)
        A_i = (r_i − mean(group)) / (std(group) + eps)               (advantages)
        μ times: update π_θ on the clipped surrogate − β·KL          (update)
        update r_φ by continuous training with replay                (learned reward models only)

Everything the loop calls is a short method below it; the maths lives in `algo.py`, the update's
micro-batches, accumulation and optimizer step in `policy_update.py`, the log-probs in `logprobs.py`,
what each step reports in `step_log.py`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import run_guard
from .algo import group_advantages, overlong_penalty
from .dynamic_sampling import fill_informative
from .config import GRPOConfig
from .distributed import Parallel, SilentMetrics, check_parallel_options, silent
from .errors import CohortError
from .lora import adapters_disabled, apply_lora, has_lora, lora_config_from_args, merge_into_base
from .gc_pauses import collector_seconds, freeze_long_lived_objects, thaw_frozen_objects
from .logprobs import supports_hidden
from .offload import HostOffload
from .modelio import load_policy, save_policy
from .precision import make_optimizer, resolve_dtype
from .rewards.model import prepare_reward_funcs, warm_up_reward_models
from .rewards.runner import RewardRunner
from .rollout import Rollout, SamplingParams
from .engine import make_sampler
from .evaluate import evaluate
from .curriculum import Curriculum
from .tasks import prompt_text
from .metrics import MetricsLogger
from .step_log import StepLog, allocator_retries
from .kept_layers import KeptLayers
from .policy_update import PolicyUpdate
from .progress import Progress
from .tasks.data import check_prompt_column


@dataclass
class Batch:
    """One step's rollout: B = prompts × G completions, everything group-contiguous."""

    rows: list[dict]  # the dataset row of each completion (repeated G times)
    prompt_ids: list[list[int]]  # [B] prompt token ids
    rollout: Rollout  # completion ids [B, T], mask [B, T], finish reasons
    completions: list  # decoded completions (str, or chat messages for chat prompts)
    rewards: torch.Tensor | None = None  # [B]
    advantages: torch.Tensor | None = None  # [B]
    old_logp: torch.Tensor | None = None  # [B, T] log π_old, when μ > 1
    ref_logp: torch.Tensor | None = None  # [B, T] log π_ref, when β > 0
    per_function: torch.Tensor | None = None  # [B, F] each reward function's score (NaN = not scored)
    reward_metrics: dict | None = None


class GRPOTrainer(PolicyUpdate, StepLog):
    def __init__(self, model, reward_funcs=None, train_dataset=None, args: GRPOConfig | None = None,
                 processing_class=None, eval_dataset=None, task=None, log=print, peft_config=None):
        self.args = args = (args or GRPOConfig()).validate()
        self.task = task
        self.log = log
        _seed_everything(args.seed)
        run_guard.prepare_output_dir(args, log)  # writable; an earlier run's checkpoints not overwritten by accident
        self.parallel = Parallel.from_env(args.device, args.ddp_timeout)  # torchrun's ranks (cohort/distributed.py)
        self.device = self.parallel.device
        self.model, self.tokenizer = load_policy(model, processing_class, device=self.device, log=log,
                                                 dtype=resolve_dtype(args.dtype, self.device),
                                                 trust_remote_code=args.trust_remote_code, impl=args.model_impl)
        peft_config = peft_config if peft_config is not None else lora_config_from_args(args)
        if peft_config is not None:  # LoRA: adapters injected in place; π_ref = the base model (adapters off)
            apply_lora(self.model, peft_config)
        if self.tokenizer.eos_token_id is None:
            raise CohortError("the tokenizer has no EOS token; completions could never end — set tokenizer.eos_token")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        # Curriculum (issue 3): stages switch the prompt source and, unless reward_funcs are given, the rewards.
        self.curriculum = Curriculum.from_config(args, keep_rewards=reward_funcs is not None or bool(args.reward_funcs))
        if reward_funcs is None and args.reward_funcs:
            reward_funcs = list(args.reward_funcs)  # --reward_funcs: names, module:function, reward-model folders
        if reward_funcs is None:
            if task is None:
                raise CohortError("no reward functions: pass reward_funcs=[...] or a task")
            reward_funcs = list(task.reward_funcs)
            args.reward_weights = args.reward_weights or list(task.reward_weights)
        reward_funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        # Reward-model folders / model objects become r_φ reward functions (cohort/rewards/model.py).
        reward_funcs = prepare_reward_funcs(list(reward_funcs), args=args, tokenizer=self.tokenizer,
                                            device=self.device, task=task)
        self.rewards = RewardRunner(list(reward_funcs), args.reward_weights, timeout_s=args.reward_timeout)
        self.train_rows = _as_rows(train_dataset, "train_dataset")
        self.eval_rows = _as_rows(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        self.rewards.check_columns(set(self.train_rows[0]))
        check_parallel_options(args, self.parallel)
        if args.torch_compile and hasattr(self.model, "compile_for_training"):
            self.model.compile_for_training()  # fused elementwise work, fewer saved activations
        # Recompute layers in the backward (activations ∝ layers, not ops): all, the first N, or with
        # `auto` as many as the memory budget makes necessary (cohort/kept_layers.py).
        self.kept_layers = KeptLayers.setup(self.model, args, self.device) if args.gradient_checkpointing else None
        # What the training forward calls: the model itself, DDP around it on several ranks, or with
        # --fsdp a sharded copy (self.model then stays the full copy the engine samples and saves).
        self.train_model = self.parallel.wrap(self.model, fsdp=args.fsdp)
        # bf16 weights on a GPU: the optimizer keeps fp32 masters and moments (cohort/precision.py).
        self.optimizer = make_optimizer(self.train_model, args)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # β = 0 needs no reference at all: skip the copy and its forward passes.
        self.uses_reference = args.beta > 0
        self.ref_model = self._frozen_copy() if self.uses_reference and not has_lora(self.model) else None
        # Memory each phase leaves idle: π_ref's weights wait on the host outside its pass, and the
        # update's gradients borrow the engine's KV cache (one process: DDP and FSDP own their gradients).
        self.ref_weights = HostOffload(self.ref_model, enabled=args.offload_ref_model and self.device.type == "cuda"
                                       and not args.fsdp)
        self.lend_kv_cache = args.lend_kv_cache and self.parallel.world_size == 1 and not args.fsdp
        self.micro_rows, self.micro_tokens = args.per_device_train_batch_size, args.max_tokens_per_micro_batch
        # The G completions of a prompt share its forward in the log-prob passes and the update: our
        # models only (they take attention rows), and only where a prompt has several completions.
        self.share_prompts = bool(args.share_prompt_prefix and args.num_generations > 1 and supports_hidden(self.model))
        self.oom_retries = 0
        self.sampler = make_sampler(self.model, self.tokenizer)
        self.data_rng = random.Random(args.seed)
        self.data_order: list[int] = []
        self.history: list[dict] = []
        self.step = 0
        self.phase_times: dict[str, float] = {}
        self.phase_peaks: dict[str, float] = {}  # GiB, CUDA only
        self.accuracy_before = self.accuracy_after = None
        self.skipped_steps = self.nonfinite_in_a_row = 0  # updates skipped for a non-finite loss / gradient
        self.gc_mark = collector_seconds()  # the garbage collector's pauses so far (each step logs its own)
        self.alloc_retry_mark = allocator_retries(self.device)  # likewise the CUDA allocator's retries
        self.sequence_offset = 0  # global index of this rank's first completion in the step's batch
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        main = self.parallel.is_main  # rank 0 alone logs, prints and saves
        self.metrics = MetricsLogger(args.output_dir, args.report_to, config=args.to_dict()) if main else SilentMetrics()
        self.progress = Progress(args.max_steps, quiet=args.quiet) if main else Progress(0, True, open(os.devnull, "w"))
        self.log = (self.progress.print if log is print else log) if main else silent

    # ---- Algorithm 1 -------------------------------------------------------------------------
    def train(self) -> list[dict]:
        args = self.args
        started_run = time.perf_counter()
        try:
            self.resume()  # --resume: continue from the newest complete checkpoint, exactly
            self.first_step = self.step + 1
            if self.step == 0:
                self.accuracy_before = self.evaluate_held_out()
                warm_up_reward_models(self)  # r_φ: offline training on the initial policy's labelled samples
            for step in range(self.step + 1, args.max_steps + 1):
                self.step = step
                started = time.perf_counter()
                self.ref_weights.prefetch()  # π_ref's weights come back from the host while the engine samples
                if args.ref_reset_steps and step > 1 and (step - 1) % args.ref_reset_steps == 0:
                    self.reset_reference()  # π_ref ← π_θ: a new outer iteration
                with self.phase("sampling"):
                    batch = self.sample_batch(self.next_prompts())  # π_old ← π_θ; G completions per prompt
                with self.phase("rewards"):
                    self.score(batch)  # rewards r_φ(q, o_i)
                batch = self.refill_uninformative(batch)  # DAPO dynamic sampling (off by default)
                batch.advantages = group_advantages(batch.rewards, args.num_generations, args.scale_rewards)
                with self.phase("logprobs"):
                    self.reference_logprobs(batch)  # log π_old (μ > 1) and log π_ref (β > 0), once per step
                with self.phase("update"):
                    losses = [self.update(batch) for _ in range(args.num_iterations)]  # μ policy updates
                if self.parallel.fsdp:
                    with self.phase("gather"):  # FSDP2: the updated shards into the full copy the engine samples
                        self.parallel.refresh_sampling_model()
                with self.phase("reward_model"):
                    self.update_reward_models(batch)  # r_φ: continuous training with replay (learned r_φ only)
                self.record_step(batch, losses, time.perf_counter() - started)
                if args.gc_freeze and step == self.first_step:  # the run's long-lived objects exist now
                    freeze_long_lived_objects()  # full collections stop walking them (cohort/gc_pauses.py)
                    self.gc_mark = collector_seconds()  # that one collection is not the next step's pause
                if args.eval_steps and step % args.eval_steps == 0 and step < args.max_steps:
                    self.evaluate_held_out()
                self.maybe_save_checkpoint()  # every save_steps and at the end; on SIGINT/SIGTERM save and stop
            self.log_iteration_summary(final=True)
            self.accuracy_after = self.evaluate_held_out()
            self.finish(time.perf_counter() - started_run)
            return self.history
        finally:
            thaw_frozen_objects()  # a later run in this process can reclaim this run's objects

    # ---- the steps of the loop ---------------------------------------------------------------
    def next_prompts(self) -> list[dict]:
        """This rank's prompts_per_step rows of the next prompts_per_step × ranks, walking a shuffled
        order of the data (epochs repeat). Every rank walks the same order and takes its own
        contiguous block of whole prompts, so a prompt's G completions stay on one rank."""
        if self.curriculum is not None:
            self.curriculum.enter(self)  # at a stage boundary: that stage's rows (and reward functions)
        rows = []
        while len(rows) < self.args.prompts_per_step * self.parallel.world_size:
            if not self.data_order:
                self.data_order = list(range(len(self.train_rows)))
                self.data_rng.shuffle(self.data_order)
            rows.append(self.train_rows[self.data_order.pop()])
        self.sequence_offset = self.args.prompts_per_step * self.parallel.rank * self.args.num_generations
        return self.parallel.shard(rows)

    def sample_batch(self, rows: list[dict]) -> Batch:
        args, G = self.args, self.args.num_generations
        prompt_ids = [self.encode_prompt(r["prompt"]) for r in rows]
        params = SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, eos_token_ids=[self.tokenizer.eos_token_id],
            pad_token_id=self.pad_id, seed=self.data_rng.randrange(2**31),  # the same on every rank
            sequence_offset=self.sequence_offset,  # global index of this rank's first completion
        )
        rollout = self.sampler.generate(prompt_ids, G, params)
        if self.args.free_sampling_memory and self.device.type == "cuda" and hasattr(self.sampler, "release"):
            self.sampler.release()  # KV cache and decode graphs out of the update's memory (recaptured next step)
        texts = [self.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]
        chat = isinstance(rows[0]["prompt"], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        return Batch(rows=[r for r in rows for _ in range(G)], prompt_ids=[p for p in prompt_ids for _ in range(G)],
                     rollout=rollout, completions=completions)

    def score(self, batch: Batch) -> None:
        columns = {k: [r[k] for r in batch.rows] for k in batch.rows[0] if k != "prompt"}
        ids = [ids[m.bool()].tolist() for ids, m in zip(batch.rollout.completion_ids, batch.rollout.completion_mask)]
        out = self.rewards([r["prompt"] for r in batch.rows], batch.completions, ids, columns)
        batch.rewards, batch.per_function, batch.reward_metrics = out.rewards, out.per_function, out.metrics
        if self.args.overlong_buffer_length:  # DAPO soft overlong punishment, part of the reward
            penalty = overlong_penalty(batch.rollout.completion_mask.sum(dim=1), self.args.max_completion_length,
                                       self.args.overlong_buffer_length, self.args.overlong_penalty_factor)
            batch.rewards = batch.rewards + penalty.to(batch.rewards.dtype)
            batch.reward_metrics = {**batch.reward_metrics, "rewards/overlong_penalty": float(penalty.mean())}

    def refill_uninformative(self, batch: Batch) -> Batch:
        """DAPO dynamic sampling: swap all-equal-reward groups for freshly sampled informative ones."""
        if not self.args.dynamic_sampling:
            return batch

        def sample_more() -> Batch:
            more = self.sample_batch(self.next_prompts())
            self.score(more)
            return more

        with self.phase("resampling"):
            batch, stats = fill_informative(batch, sample_more, prompts_needed=self.args.prompts_per_step,
                                            group_size=self.args.num_generations,
                                            max_resample_tries=self.args.max_resample_tries, pad_id=self.pad_id)
        batch.reward_metrics = {**(batch.reward_metrics or {}), **stats}
        return batch

    def reference_logprobs(self, batch: Batch) -> None:
        """π_old's log-probs are needed only when μ > 1 (at μ = 1, π_old = π_θ and ρ ≡ 1)."""
        if self.args.num_iterations > 1:
            batch.old_logp = self.with_oom_retry(lambda: self._logprobs_no_grad(self.model, batch))
        if self.ref_model is not None:
            with self.ref_weights.on_device():
                batch.ref_logp = self.with_oom_retry(lambda: self._logprobs_no_grad(self.ref_model, batch))
        elif self.uses_reference:  # LoRA: the reference is this very model with its adapters switched off
            with adapters_disabled(self.model):
                batch.ref_logp = self.with_oom_retry(lambda: self._logprobs_no_grad(self.model, batch))

    def update_reward_models(self, batch: Batch) -> None:
        """Algorithm 1, last line: each learned reward model r_φ (a reward function with `on_step_end`)
        trains on this step's samples with replay; its rm/* metrics join the step's record."""
        hooks = [f for f in self.rewards.funcs if hasattr(f, "on_step_end")]
        if not hooks:
            return
        columns = {k: [r[k] for r in batch.rows] for k in batch.rows[0] if k != "prompt"}
        ids = [ids[m.bool()].tolist() for ids, m in zip(batch.rollout.completion_ids, batch.rollout.completion_mask)]
        for func in hooks:
            metrics = func.on_step_end([r["prompt"] for r in batch.rows], batch.completions, ids,
                                       group_size=self.args.num_generations, step=self.step, **columns)
            for key, value in metrics.items():
                batch.reward_metrics[key if key not in batch.reward_metrics else f"{func.__name__}/{key}"] = value

    def resume(self) -> None:
        """Load the checkpoint --resume / resume_from_checkpoint names (cohort/run_guard.py)."""
        run_guard.resume(self)

    def maybe_save_checkpoint(self) -> None:
        """checkpoint-<step> every save_steps and at the last step (cohort/run_guard.py)."""
        run_guard.maybe_save(self)

    def reset_reference(self) -> None:
        """π_ref ← π_θ: copy the weights, or with LoRA fold the adapters into the base (lora.py)."""
        if self.ref_model is not None:
            with self.ref_weights.on_device(modified=True):
                self.ref_model.load_state_dict(self.model.state_dict())
        elif has_lora(self.model) and self.uses_reference:
            for param in merge_into_base(self.model):
                self.optimizer.state.pop(param, None)  # B restarts at 0: its AdamW moments start over too
        self.log_iteration_summary()

    # ---- helpers -----------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> list[int]:
        text = prompt_text(self.tokenizer, prompt)  # the same rendering as evaluation and SFT
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.args.max_prompt_length:
            raise CohortError(
                f"a prompt has {len(ids)} tokens, more than max_prompt_length={self.args.max_prompt_length}; "
                "raise --max_prompt_length or filter long prompts")
        return ids

    def _frozen_copy(self):
        ref = copy.deepcopy(self.model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _lr_factor(self, step: int) -> float:
        args = self.args
        if args.warmup_steps and step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        if args.lr_scheduler_type == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if args.lr_scheduler_type == "linear":
            return 1.0 - progress
        return 1.0

    def evaluate_held_out(self) -> float | None:
        """Greedy accuracy on the held-out rows (None without eval_dataset or a task verifier)."""
        if not self.eval_rows or self.task is None:
            return None
        with self.phase("eval"):  # each rank evaluates its block of the rows; the counts are summed
            result = evaluate(self.sampler, self.tokenizer, self.task, self.parallel.shard(self.eval_rows),
                              self.encode_prompt, max_new_tokens=self.args.max_completion_length)
            result = result.summed(self.parallel.all_reduce_sums)
        self.metrics.log(self.step, result.metrics())
        self.log(f"eval (step {self.step}): accuracy={100 * result.accuracy:.1f}% on {result.num_questions} problems")
        return result.accuracy

    def finish(self, seconds: float) -> None:
        """Final policy as a Hugging Face folder, summary.json, and the held-out accuracy line."""
        out = Path(self.args.output_dir)
        self.save_model(out)
        self.parallel.close()  # the last collective was save_model's barrier
        if not self.parallel.is_main:  # rank 0 alone writes the summary and prints
            self.progress.close()
            run_guard.finish(self)
            return
        summary = {"accuracy_before": self.accuracy_before, "accuracy_after": self.accuracy_after,
                   "seconds": round(seconds, 2), "steps": self.step,
                   "final_reward": self.history[-1]["reward"] if self.history else None}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.close()
        self.progress.close()
        run_guard.finish(self)  # SIGINT / SIGTERM back to their previous handlers
        if self.accuracy_before is not None:
            self.log(f"held-out accuracy: {100 * self.accuracy_before:.1f}% -> {100 * self.accuracy_after:.1f}% "
                     f"({len(self.eval_rows)} problems)")

    def save_model(self, output_dir: str | None = None) -> Path:
        """The policy as a Hugging Face folder, written by rank 0 (the others wait for it)."""
        out = Path(output_dir or self.args.output_dir)
        if self.parallel.is_main:
            save_policy(self.model, self.tokenizer, out)
        self.parallel.barrier()
        return out


def _as_rows(dataset, name: str) -> list[dict]:
    if dataset is None:
        raise CohortError(f"{name} is missing: pass a list of rows with a 'prompt' column")
    rows = [dict(r) for r in dataset]
    if not rows:
        raise CohortError(f"{name} is empty: it needs at least one row with a 'prompt' column")
    if "prompt" not in rows[0]:
        raise CohortError(f"{name} has no 'prompt' column (columns: {sorted(rows[0])}); rename the prompt column to 'prompt'")
    check_prompt_column(rows, name)  # wrong types fail here, not mid-run
    return rows


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
