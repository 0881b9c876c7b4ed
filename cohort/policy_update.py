"""The update half of a GRPO step: π_θ's gradient over the rollout, micro-batch by micro-batch, and
one optimizer step; the no-grad log-prob passes it needs; and the out-of-memory retry around both.

A mixin of `GRPOTrainer` (as `StepLog` is), so that trainer.py shows Algorithm 1's loop and this
file the mechanics of one "update π_θ" line of it: length-bucketed micro-batches (packing.py),
the loss of each (head_loss.py, whose maths is algo.py's), gradients accumulated in the engine's
idle KV cache (lending.py), clipping and the fp32-master AdamW step (precision.py).
"""

from __future__ import annotations

import gc
import math
from typing import TYPE_CHECKING

import torch

from . import run_guard
from .head_loss import micro_batch_policy_loss
from .lending import idle_buffers, lend_gradients
from .logprobs import rollout_logprobs
from .packing import MicroBatch, pack, plan_rollout, to_device
from .precision import clip_grad_norm

if TYPE_CHECKING:
    from .trainer import Batch

NO_GRAD_FACTOR = 2  # no-grad log-prob passes (π_old, π_ref) use micro-batches this many times larger


class PolicyUpdate:
    def update(self, batch: Batch) -> dict:
        """One optimizer step over the whole rollout (μ of these per rollout)."""
        if self.kept_layers is not None:  # gradient_checkpointing_layers=auto: decides once, after the first update
            line = self.kept_layers.decide(self.largest_micro_batch_tokens())
            if line:
                self.log(line)

        def attempt():
            self.optimizer.zero_grad(set_to_none=True)
            buffers = idle_buffers(self.sampler) if self.lend_kv_cache else []
            with lend_gradients(self.train_model.parameters(), buffers) as lent:  # gradients in the idle KV cache
                record = {**self._accumulate_and_step(batch), "memory/lent_gib": lent / 2**30}
            if self.kept_layers is not None:
                record["recomputed_layers"] = self.kept_layers.recomputed
            return record
        record = self.with_oom_retry(attempt, backward=True)
        if self.kept_layers is not None:
            self.kept_layers.after_update()
        return record

    def _accumulate_and_step(self, batch: Batch) -> dict:
        """Gradient accumulation over length-bucketed micro-batches, then one optimizer step.

        The loss normalisers (completions; tokens for DAPO) are global over the rollout and over
        ranks, so the micro-batch split never changes the gradient."""
        args = self.args
        self.train_model.train()
        keep_rows = self.loss_rows(batch)
        local_rows = len(batch.rows)
        total = self.parallel.all_reduce_sum(local_rows)
        mask_all = batch.rollout.completion_mask * keep_rows.unsqueeze(1)
        num_tokens = max(self.parallel.all_reduce_sum(float(mask_all.sum())), 1.0) if args.loss_type == "dapo" else None
        world = self.parallel.world_size
        plans = self.micro_batch_plan(batch, self.micro_rows, self.micro_tokens)
        # The step's per-row tensors go to the device once; each micro-batch gathers its rows there.
        # Nothing in the loop waits for the GPU: statistics stay tensors until the loop has ended.
        old_all, ref_all, advantages_all, keep_all = (
            None if t is None else to_device(t, self.device)
            for t in (batch.old_logp, batch.ref_logp, batch.advantages, keep_rows))
        sums: dict[str, torch.Tensor] = {}
        for i, rows in enumerate(plans):
            micro = self.pack(batch, rows)
            index = micro.row_index
            with self.parallel.no_sync(self.train_model, last=i == len(plans) - 1):  # DDP reduces after the last backward
                width = micro.completion_ids.shape[1]
                advantages = advantages_all[index] if advantages_all.dim() == 1 else advantages_all[index, :width]
                loss, stats, out = micro_batch_policy_loss(
                    self.train_model, micro, old_logp=None if old_all is None else old_all[index, :width],
                    ref_logp=None if ref_all is None else ref_all[index, :width], advantages=advantages,
                    loss_mask=micro.completion_mask * keep_all[index].unsqueeze(1),  # truncated rows out, when asked
                    temperature=args.temperature or 1.0, fused=args.fused_head_loss, epsilon=args.epsilon,
                    epsilon_high=args.epsilon_high, beta=args.beta, loss_type=args.loss_type,
                    max_completion_length=args.max_completion_length, num_tokens=num_tokens,
                    importance_sampling_level=args.importance_sampling_level, entropy_coef=args.entropy_coef,
                )  # None for π_old: at μ = 1 it is π_θ itself
                # Token-level DAPO already divides by the whole batch's tokens; the others average
                # micro-batches by their share of completions. DDP averages over ranks: × world.
                weight = (1.0 if args.loss_type == "dapo" else len(rows) / total) * world
                (loss * weight).backward()
            share = len(rows) / local_rows
            stats["loss"] = loss.detach() * (1.0 if args.loss_type != "dapo" else 1 / share)
            mask = micro.completion_mask
            stats["entropy"] = (out.entropy * mask).sum() / mask.sum().clamp(min=1)
            for k, v in stats.items():
                sums[k] = sums[k] + v * share if k in sums else v * share
        grad_norm = clip_grad_norm(self.optimizer, self.train_model, args.max_grad_norm)  # FSDP2: the sharded grads
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
        names = list(sums)
        values = torch.stack([sums[k].float() for k in names] + [torch.as_tensor(grad_norm).float().to(self.device)])
        record = dict(zip(names + ["grad_norm"], values.tolist()))  # the step's one host sync
        if run_guard.update_is_finite(self, record.get("loss", 0.0), record["grad_norm"]):  # NaN/inf: skip, count
            self.optimizer_step()
            self.scheduler.step()  # as transformers' Trainer: the schedule advances with real updates only
        # Free the gradients now, not at the next update: fp32 master gradients (4 bytes a parameter)
        # would otherwise sit through the next rollout and log-prob pass.
        self.optimizer.zero_grad(set_to_none=True)
        record["micro_batches"] = len(plans)
        return record

    def optimizer_step(self) -> None:
        """The optimizer step; the fp32-master step halves its chunks instead of failing when one
        runs out of memory (precision.py), and each halving is logged and counted as a retry."""
        shrinks = getattr(self.optimizer, "chunk_shrinks", 0)
        self.optimizer.step()
        if getattr(self.optimizer, "chunk_shrinks", 0) > shrinks:
            self.oom_retries += self.optimizer.chunk_shrinks - shrinks
            self.log(f"out of GPU memory in the optimizer step: it now steps at most "
                     f"{self.optimizer.chunk_bytes / 2**20:.1f} MiB of fp32 gradients at a time")

    def largest_micro_batch_tokens(self) -> int:
        """Tokens a training micro-batch can reach under the current budgets: every row at the
        longest prompt and completion, each prompt computed once per group of G rows with shared
        prompts (`packing.plan_rollout` keeps a group's rows together)."""
        rows, group = self.micro_rows, self.args.num_generations
        prompts = math.ceil(rows / min(group, rows)) if self.share_prompts else rows
        tokens = prompts * self.args.max_prompt_length + rows * self.args.max_completion_length
        return min(tokens, self.micro_tokens) if self.micro_tokens else tokens

    def with_oom_retry(self, work, backward: bool = False):
        """Run `work()`; if the GPU runs out of memory, halve the micro-batch and run it again.
        Work with a `backward` first gives up layers that keep their activations, if any do
        (gradient_checkpointing_layers=auto): the no-grad passes keep none, so that would not help them.

        The halved size is kept for the rest of the run. The retried work starts from zeroed
        gradients and an untouched optimizer, so its result is that of the smaller size from the
        start. Several ranks cannot retry alone (the others would wait in an all-reduce)."""
        while True:
            try:
                return work()
            except torch.cuda.OutOfMemoryError:
                self.optimizer.zero_grad(set_to_none=True)
                if self.parallel.world_size > 1:
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if backward and self.kept_layers is not None and self.kept_layers.recompute_all():  # before halving
                    self.oom_retries += 1
                    self.log("out of GPU memory with layers keeping their activations (gradient_checkpointing_layers"
                             "=auto): recomputing every layer from now on")
                    continue
                if self.micro_rows == 1:  # one row: no smaller micro-batch exists
                    raise
                before = (self.micro_rows, self.micro_tokens)
                self.micro_rows = max(1, self.micro_rows // 2)
                self.micro_tokens //= 2
                self.oom_retries += 1
                self.log(f"out of GPU memory with micro-batches of {before[0]} completions"
                         f"{f' / {before[1]} tokens' if before[1] else ''}: retrying with {self.micro_rows}"
                         f"{f' / {self.micro_tokens} tokens' if self.micro_tokens else ''}")

    def loss_rows(self, batch: Batch) -> torch.Tensor:
        """[B] 1/0: which completions enter the loss (TRL's mask_truncated_completions drops those cut at the limit)."""
        keep = torch.ones(len(batch.rows), dtype=batch.rollout.completion_mask.dtype)
        if self.args.mask_truncated_completions:
            keep = torch.tensor([r != "length" for r in batch.rollout.finish_reasons], dtype=keep.dtype)
        return keep

    def micro_batch_plan(self, batch: Batch, max_rows: int, max_tokens: int) -> list[list[int]]:
        """Rows of the rollout grouped by length (and prompt) into micro-batches (cohort/packing.py)."""
        return plan_rollout(batch.prompt_ids, batch.rollout.completion_mask, max_rows, max_tokens, self.share_prompts)

    def pack(self, batch: Batch, rows: list[int]) -> MicroBatch:
        """Rows `rows` packed for one forward (each prompt once, or one padded row per completion), on the
        training device."""
        return pack(batch.prompt_ids, batch.rollout.completion_ids, batch.rollout.completion_mask, rows, self.pad_id,
                    self.share_prompts).to(self.device)

    def _logprobs_no_grad(self, model, batch: Batch) -> torch.Tensor:
        """[B, T] log-probs under `model` in inference mode; no activations are kept, so the
        micro-batches are NO_GRAD_FACTOR times larger than the training ones."""
        model.eval()
        return rollout_logprobs(model, batch.prompt_ids, batch.rollout.completion_ids, batch.rollout.completion_mask,
                                pad_id=self.pad_id, max_rows=self.micro_rows * NO_GRAD_FACTOR,
                                max_tokens=self.micro_tokens * NO_GRAD_FACTOR, temperature=self.args.temperature or 1.0,
                                share_prompts=self.share_prompts)
