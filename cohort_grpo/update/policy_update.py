"""`PolicyUpdate`: Algorithm 1's "update π_θ" line, one optimizer step over the whole rollout.

The step is gradient accumulation over length-bucketed micro-batches (`packing.py`), each one's loss
being `objectives.policy_loss` (through the fused head where it applies, `fused_head.py`), then
clipping and the optimizer step (fp32 masters on a GPU, `memory/precision.py`). The loss's settings
are one `LossSpec`, built once from the config; each micro-batch tells the loss its `BatchShare` of the
step (completions and tokens over every rank), from which `objectives.aggregate_loss` normalises, so
the micro-batch split never changes the gradient. An update whose loss or gradient norm is NaN/inf,
or any of whose loss tokens has a NaN/inf log-prob or importance ratio, is skipped and counted: one
bad batch must not poison the weights and the Adam moments.

Memory is the `MemoryManager`'s business: it sets the micro-batch sizes, lends the gradients their
storage and retries a step that ran out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from cohort_grpo.algorithm.loss_spec import BatchShare, LossSpec
from cohort_grpo.algorithm.objectives import MICRO_BATCH_MEAN, aggregate_loss
from cohort_grpo.memory.manager import MemoryManager
from cohort_grpo.optim.optimizer import clip_grad_norm
from cohort_grpo.rollout.batch import Batch, to_device
from cohort_grpo.rollout.layout import Layout
from cohort_grpo.rollout.sampling import Truncation
from cohort_grpo.update.fused_head import micro_batch_policy_loss
from cohort_grpo.update.logprobs import is_fully_sharded, rollout_logprobs
from cohort_grpo.update.packing import MicroBatch, filler_micro_batches, pack
from cohort_grpo.update.routing import expert_load, num_experts, replay_mismatch, router_aux_loss


@dataclass
class UpdateCounters:
    """Updates skipped for a non-finite loss, gradient, log-prob or importance ratio: in all, and in a row
    up to now."""

    skipped_steps: int = 0
    nonfinite_in_a_row: int = 0


class PolicyUpdate:
    def __init__(self, args, *, train_model, optimizer, scheduler, memory: MemoryManager, parallel,
                 device: torch.device, pad_id: int, layout: Layout, loss: LossSpec,
                 log: Callable[[str], None] = print):
        self.args, self.train_model, self.optimizer, self.scheduler = args, train_model, optimizer, scheduler
        self.loss = loss
        self.memory, self.parallel, self.device, self.pad_id = memory, parallel, device, pad_id
        self.layout, self.log = layout, log
        self.counters = UpdateCounters()
        self.steps_reached = 0  # `optimizer_steps()`
        self.num_experts = num_experts(train_model)  # 0: a dense model, no routing to replay or report

    def __call__(self, batch: Batch, step: int) -> dict:
        """One optimizer step over `batch` (μ of these per rollout); returns the update's statistics."""
        self.memory.before_update()

        def attempt() -> dict:
            self.optimizer.zero_grad(set_to_none=True)
            with self.memory.update(self.train_model.parameters()):  # gradients in the idle KV cache
                record = self.accumulate_and_step(batch, step)
            return {**record, **self.memory.update_metrics()}

        record = self.memory.run(attempt, backward=True, release=lambda: self.optimizer.zero_grad(set_to_none=True))
        self.memory.after_update()
        return record

    def optimizer_steps(self) -> int:
        """How many updates of this process reached their optimizer step (taken, or skipped for a non-finite
        value). While it stays the same, the weights and the optimizer's state are those the last step left: a
        failure then loses nothing a checkpoint of that step cannot restore (cohort_grpo/run/failure.py)."""
        return self.steps_reached

    def accumulate_and_step(self, batch: Batch, step: int) -> dict:
        """Gradient accumulation over the micro-batches, then one optimizer step."""
        args = self.args
        self.train_model.train()
        keep_rows = self.loss_rows(batch)
        local_rows = len(batch.rows)
        # Only the tokens the model sampled are trained on: tool results appended between turns are not.
        mask_all = batch.rollout.loss_mask * keep_rows.unsqueeze(1)
        total_rows, total_tokens = self.parallel.all_reduce_sums([local_rows, float(mask_all.sum())])
        world = self.parallel.world_size
        plans = self.plan(batch)
        runs = plans + filler_micro_batches(plans, self.agreed_forwards(self.train_model, len(plans)))
        # The step's per-row tensors go to the device once; each micro-batch gathers its rows there.
        # Nothing in the loop waits for the GPU: statistics stay tensors until the loop has ended.
        sampling = batch.rollout.logprobs  # the sampler's own log-probs (None from HF generate)
        old_all, ref_all, advantages_all, keep_all, sampling_all, tool_all = (
            None if t is None else to_device(t, self.device)
            for t in (batch.old_logp, batch.ref_logp, batch.advantages, keep_rows, sampling, batch.rollout.tool_mask))
        sums: dict[str, torch.Tensor] = {}
        loss = nonfinite = torch.zeros((), device=self.device)
        for i, rows in enumerate(runs):
            filler = i >= len(plans)  # a forward and backward only as many as the other ranks run: weight 0
            micro = self.pack(batch, rows)
            index = micro.row_index
            with self.parallel.no_sync(self.train_model, last=i == len(runs) - 1):  # DDP reduces after the last backward
                width = micro.completion_ids.shape[1]
                advantages = advantages_all[index] if advantages_all.dim() == 1 else advantages_all[index, :width]
                mask = micro.completion_mask if tool_all is None else micro.completion_mask * tool_all[index, :width]
                batch_share = BatchShare(len(rows), int(total_rows), max(total_tokens, 1.0), world)
                out = micro_batch_policy_loss(
                    self.train_model, micro, old_logp=None if old_all is None else old_all[index, :width],
                    ref_logp=None if ref_all is None else ref_all[index, :width], advantages=advantages,
                    loss_mask=mask * keep_all[index].unsqueeze(1),  # truncated rows out, when asked
                    spec=self.loss, share=batch_share,
                    sampling_logp=None if sampling_all is None else sampling_all[index, :width],
                    temperature=args.temperature or 1.0, fused=args.fused_head_loss, truncation=Truncation.of(args),
                )  # None for π_old: at μ = 1 it is π_θ itself
                stats, objective = dict(out.stats), out.loss
                if micro.routing is not None:  # a mixture of experts: its routing statistics and load-balancing loss
                    routing_stats, router_term = self.routing_terms(micro, batch_share)
                    stats, objective = {**stats, **routing_stats}, objective + router_term
                # normalised for the whole step already (objectives.aggregate_loss); a filler adds exact zeros
                (objective * 0.0 if filler else objective).backward()
            if filler:
                continue
            # Averaged over ranks (the step report's mean), these sums are the step's loss.
            loss, nonfinite = loss + out.loss.detach(), nonfinite + out.nonfinite
            share = len(rows) / local_rows
            stats["entropy"] = (out.entropy * mask).sum() / mask.sum().clamp(min=1)
            for k, v in stats.items():  # the step's mean over micro-batches; extremes for /max and /min
                if k in sums and k.endswith(("/max", "/min")):
                    sums[k] = torch.maximum(sums[k], v) if k.endswith("/max") else torch.minimum(sums[k], v)
                elif k.endswith(("/max", "/min")):
                    sums[k] = v
                else:
                    sums[k] = sums[k] + v * share if k in sums else v * share
        grad_norm = clip_grad_norm(self.optimizer, self.train_model, args.max_grad_norm)  # FSDP2: the sharded grads
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
        names = ["loss", *sums, "grad_norm", "nonfinite_logprobs"]
        values = torch.stack([loss.float(), *(v.float() for v in sums.values()),
                              torch.as_tensor(grad_norm).float().to(self.device), nonfinite.float()])
        record = dict(zip(names, values.tolist()))  # the step's one host sync
        # Every rank skips or none does: a NaN log-prob on one rank need not make the others' gradients NaN.
        record["nonfinite_logprobs"] = int(self.parallel.all_reduce_sum(record["nonfinite_logprobs"]))
        self.steps_reached += 1  # from here on the optimizer's state, the weights or the counters change
        if self.is_finite(record, step):  # NaN/inf: skipped, counted
            self.optimizer_step()
            self.scheduler.step()  # as transformers' Trainer: the schedule advances with real updates only
        # Free the gradients now, not at the next update: fp32 master gradients (4 bytes a parameter)
        # would otherwise sit through the next rollout and log-prob pass.
        self.optimizer.zero_grad(set_to_none=True)
        record["micro_batches"] = len(plans)
        if self.num_experts:
            load = expert_load(batch.rollout, [len(p) for p in batch.prompt_ids], self.num_experts)
            if load is not None:
                record["routing/expert_load_max_over_mean"] = load
        return record

    def routing_terms(self, micro: MicroBatch, share: BatchShare) -> tuple[dict, torch.Tensor | float]:
        """A mixture-of-experts micro-batch's routing statistics (the replay mismatch, the load-balancing loss), and
        the load-balancing loss's term of the objective (0.0 without `router_aux_loss_coef`), weighed for the step
        as the policy loss is: by `objectives.aggregate_loss`, from the micro-batch's `share`."""
        stats, term = {}, 0.0
        if (mismatch := replay_mismatch(micro)) is not None:
            stats["routing/replay_mismatch"] = mismatch
        if self.args.router_aux_loss_coef:
            aux = router_aux_loss(micro, self.num_experts)
            stats["routing/aux_loss"] = aux.detach()
            term = aggregate_loss(self.args.router_aux_loss_coef * aux, None, MICRO_BATCH_MEAN, share=share)
        return stats, term

    def is_finite(self, record: dict, step: int) -> bool:
        """False (and the gradients dropped, the skip counted) when the step's loss or gradient norm is
        NaN/inf, or some loss token's log-prob or importance ratio was (`nonfinite_logprobs`, all ranks)."""
        counters = self.counters
        loss, grad_norm, tokens = record["loss"], record["grad_norm"], record["nonfinite_logprobs"]
        if np.isfinite(loss) and np.isfinite(grad_norm) and tokens == 0:
            counters.nonfinite_in_a_row = 0
            return True
        self.optimizer.zero_grad(set_to_none=True)
        counters.skipped_steps += 1
        counters.nonfinite_in_a_row += 1
        self.log(f"step {step}: non-finite loss ({loss}), gradient norm ({grad_norm}) or log-probs / importance "
                 f"ratio ({tokens} tokens): update skipped ({counters.nonfinite_in_a_row} in a row, "
                 f"{counters.skipped_steps} in all)")
        return False

    def optimizer_step(self) -> None:
        """The optimizer step; the fp32-master step halves its chunks instead of failing when one
        runs out of memory (precision.py), and the memory manager logs and counts each halving."""
        shrinks = getattr(self.optimizer, "chunk_shrinks", 0)
        self.optimizer.step()
        if getattr(self.optimizer, "chunk_shrinks", 0) > shrinks:
            self.memory.optimizer_shrank(self.optimizer.chunk_shrinks - shrinks, self.optimizer.chunk_bytes)

    # ---- the rollout in micro-batches (PPO's critic uses these too) ------------------------------
    def loss_rows(self, batch: Batch) -> torch.Tensor:
        """[B] 1/0: which completions enter the loss (TRL's mask_truncated_completions drops those cut at the limit)."""
        keep = torch.ones(len(batch.rows), dtype=batch.rollout.completion_mask.dtype)
        if self.args.mask_truncated_completions:
            keep = torch.tensor([r != "length" for r in batch.rollout.finish_reasons], dtype=keep.dtype)
        return keep

    def plan(self, batch: Batch) -> list[list[int]]:
        """Rows of the rollout grouped by length (and prompt) into micro-batches under the memory
        manager's current sizes, as the run's layout plans them (cohort_grpo/rollout/layout.py)."""
        return self.layout.plan(batch.prompt_ids, batch.rollout.completion_mask, self.memory.micro_rows,
                                self.memory.micro_tokens, batch.images)

    def agreed_forwards(self, model, count: int) -> int:
        """How many micro-batches this rank runs through `model` when it planned `count`: under FSDP2 the most
        any rank planned (each forward all-gathers the weights with the other ranks; a rank that planned fewer
        runs fillers). DDP communicates only in the last backward, once on every rank: its own count."""
        return self.parallel.max_over_ranks(count) if is_fully_sharded(model) else count

    def pack(self, batch: Batch, rows: list[int]) -> MicroBatch:
        """Rows `rows` packed for one forward (each prompt once, or one padded row per completion), on the
        training device."""
        return pack(batch.prompt_ids, batch.rollout.completion_ids, batch.rollout.completion_mask, rows, self.pad_id,
                    self.layout, **self.routing_options(batch, train=True), images=batch.images).to(self.device)

    def routing_options(self, batch: Batch, train: bool) -> dict:
        """`pack`'s routing options for a mixture-of-experts model: the sampler's routes (to replay, or only to
        measure the mismatch with), and the router's outputs for the load-balancing loss in the update."""
        if not self.num_experts:
            return {}
        options = {"routes": batch.rollout.routed_experts, "replay": self.args.routing_replay}
        return {**options, "keep_router": self.args.router_aux_loss_coef > 0} if train else options

    def logprobs(self, model, batch: Batch, layout: Layout | None = None) -> torch.Tensor:
        """[B, T] log-probs of the rollout under `model`, in inference mode (log π_old, log π_ref), with
        the memory manager's no-grad micro-batch sizes and its out-of-memory retry. `layout`: another model's
        (a teacher that is not the policy: its own layout, and no routes of the policy's experts replayed)."""
        routing = self.routing_options(batch, train=False) if layout is None else {}

        def attempt() -> torch.Tensor:
            model.eval()
            rows, tokens = self.memory.no_grad_sizes()
            return rollout_logprobs(model, batch.prompt_ids, batch.rollout.completion_ids,
                                    batch.rollout.completion_mask, pad_id=self.pad_id, max_rows=rows,
                                    max_tokens=tokens, temperature=self.args.temperature or 1.0,
                                    truncation=Truncation.of(self.args), layout=layout or self.layout,
                                    agree=lambda planned: self.agreed_forwards(model, planned), **routing,
                                    images=batch.images)
        return self.memory.run(attempt)


def sampler_correction_mode(args, model, device: torch.device) -> str | None:
    """The sampler correction in force (objectives.SAMPLER_CORRECTIONS), or None. Automatic where the
    sampler is not the policy being trained: a bf16 / fp16 policy on a GPU (float32 on the CPU agrees to
    ~1e-6), and asynchronous rollouts (sampled by an older policy)."""
    on = args.importance_sampling_correction
    if on is None:
        on = bool(getattr(args, "async_rollouts", False)) or (
            device.type == "cuda" and next(model.parameters()).dtype in (torch.bfloat16, torch.float16))
    return args.importance_sampling_mode if on else None
