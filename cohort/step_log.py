"""What the trainer reports about each step: phase timings and peak memory, the metrics record
(TRL's names where TRL has the metric), sample completions, and Algorithm 1's per-iteration summary.

A mixin of `GRPOTrainer`, kept apart so that trainer.py holds the algorithm and this file the
book-keeping around it; both read the same attributes (`args`, `history`, `phase_times`, ...).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from .gc_pauses import collector_seconds
from .metrics import rollout_attention_pairs, throughput_metrics
from .packing import computed_prompt_tokens
from .progress import PHASES

if TYPE_CHECKING:
    from .trainer import Batch


def allocator_retries(device: torch.device) -> int:
    """How many times the CUDA caching allocator has retried an allocation after emptying its cache."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


class StepLog:
    def success(self, batch: Batch) -> float:
        """Fraction of completions that solve their problem (the task's verifier), else reward > 0."""
        task = self.curriculum.task if self.curriculum is not None else self.task  # the rows' own task
        if task is not None and hasattr(task, "is_correct"):
            texts = [c if isinstance(c, str) else c[-1]["content"] for c in batch.completions]
            return float(np.mean([task.is_correct(t, r) for t, r in zip(texts, batch.rows)]))
        return float((batch.rewards > 0).float().mean())

    @contextmanager
    def phase(self, name: str):
        """Time one phase of the step (device work included) and show it on the progress display."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        with self.progress.phase(name if name in PHASES else "update"):
            yield
        if cuda:
            torch.cuda.synchronize()
            self.phase_peaks[name] = torch.cuda.max_memory_allocated(self.device) / 2**30  # which phase sets the peak
        self.phase_times[name] = time.perf_counter() - started

    def record_step(self, batch: Batch, losses: list[dict], seconds: float) -> None:
        G = self.args.num_generations
        grouped = batch.rewards.view(-1, G)
        lengths = batch.rollout.completion_mask.sum(dim=1).float()
        record = {"step": self.step}
        record.update({k: sum(d[k] for d in losses) / len(losses) for k in losses[0]})
        if not self.uses_reference:
            record.pop("kl", None)  # β = 0: no reference model, no KL to report (as TRL)
        record.update(batch.reward_metrics)
        if self.curriculum is not None:
            record.update(self.curriculum.metrics())  # curriculum/stage
        zero_std = torch.isclose(grouped.std(dim=1), torch.zeros(())).float()  # all-equal groups (TRL's test)
        record.update({
            "reward": float(batch.rewards.mean()),
            "reward_std": float(grouped.std(dim=1).mean()),
            "frac_reward_zero_std": float(zero_std.mean()),
            "informative": float(1 - zero_std.mean()),
            "success": self.success(batch),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(np.mean([r == "length" for r in batch.rollout.finish_reasons])),
            "learning_rate": self.scheduler.get_last_lr()[0],
            "num_iterations": len(losses),
            "skipped_steps": self.skipped_steps,
            "oom_retries": self.oom_retries,
            "step_time": seconds,
        })
        # Tokens of all ranks: the rates are the whole job's (MFU below: per GPU).
        # Prompt tokens as the forward passes see them: once per group when the group shares its prompt.
        # Attention's (query, key) pairs per layer, for each sliding window the layers use (MFU).
        pairs = rollout_attention_pairs(self.model, batch.prompt_ids, [int(n) for n in lengths.tolist()],
                                        self.micro_rows, self.share_prompts)
        prompt_tokens, completion_tokens, *summed_pairs = (int(n) for n in self.parallel.all_reduce_sums(
            [computed_prompt_tokens(batch.prompt_ids, self.micro_rows, self.share_prompts), float(lengths.sum()),
             *map(float, pairs.values())]))
        record.update(throughput_metrics(  # tokens/s per phase, peak memory, MFU (cohort/metrics.py)
            self.model, self.device, self.phase_times, prompt_tokens, completion_tokens, len(losses),
            logprob_passes=int(self.args.num_iterations > 1) + int(self.uses_reference),
            attention_pairs=dict(zip(pairs, summed_pairs))))
        if record.get("mfu") is not None:
            record["mfu"] /= self.parallel.world_size
        self.progress.show_rates(self.phase_times, {  # the phase bars' rates
            "sampling": (completion_tokens, "tok"), "rewards": (len(batch.rows), "seq"),
            "update": ((prompt_tokens + completion_tokens) * len(losses), "tok")})
        record.update({f"time/{k}": v for k, v in self.phase_times.items()})
        before, self.gc_mark = self.gc_mark, collector_seconds()
        record["time/gc"] = self.gc_mark - before  # Python's collector, inside the phases above
        if self.device.type == "cuda":
            # The caching allocator found no free block, freed its cache and asked CUDA again: a device
            # sync and a burst of cudaFree/cudaMalloc inside the step (fragmentation, or memory close to full).
            before, self.alloc_retry_mark = self.alloc_retry_mark, allocator_retries(self.device)
            record["memory/alloc_retries"] = self.alloc_retry_mark - before
        if self.phase_peaks:  # phases reset the CUDA peak counter: the step's peak is the largest phase peak
            record.update({f"memory/{k}_gib": v for k, v in self.phase_peaks.items()})
            record["peak_memory_gib"] = max([*self.phase_peaks.values(), record.get("peak_memory_gib") or 0.0])
        self.phase_times, self.phase_peaks = {}, {}
        record = self.parallel.mean_metrics(record)  # every rank's numbers averaged: global means
        self.history.append(record)
        if self.step % self.args.logging_steps == 0 or self.step == self.args.max_steps:
            self.metrics.log(self.step, record)
        if self.step == 1 or self.step % self.args.log_completions_steps == 0:
            self.metrics.log_completions(self.step, self.completion_samples(batch))
        self.progress.step_done(self.step, f"Step {self.step}/{self.args.max_steps}: Loss={record['loss']:.4f}, "
                                           f"Success={100 * record['success']:.2f}%, μ_iters={record['num_iterations']}")

    def completion_samples(self, batch: Batch, limit: int = 8) -> list[dict]:
        rows = []
        for i in range(min(limit, len(batch.rows))):
            scores = batch.per_function[i].tolist()
            rows.append({"prompt": batch.rows[i]["prompt"], "completion": batch.completions[i],
                         "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(self.rewards.names, scores)},
                         "reward": float(batch.rewards[i]), "advantage": float(batch.advantages[i])})
        return rows

    def log_iteration_summary(self, final: bool = False) -> None:
        M = self.args.ref_reset_steps or self.args.max_steps
        recent = self.history[-((self.step - 1) % M + 1 if final else M):] if self.history else []
        if not recent:
            return
        iteration = (recent[0]["step"] - 1) // M + 1
        self.log(f"Iteration {iteration}: avg loss={np.mean([r['loss'] for r in recent]):.4f}, "
                 f"success={100 * np.mean([r['success'] for r in recent]):.2f}%, "
                 f"avg reward={np.mean([r['reward'] for r in recent]):.4f}")
