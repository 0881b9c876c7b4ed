"""`StepReport`: what each step reports — phase timings and peak memory, the metrics record (TRL's
names where TRL has the metric), sample completions, and Algorithm 1's per-iteration summary.

It owns the run's history, the metrics files, the progress display (the step line, its legend and the
learning-health warnings of cohort_grpo/telemetry/health.py) and the phase clocks; the loop hands it each step's
batch, update statistics and counters explicitly (`record`).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from cohort_grpo.memory.gc_pauses import collector_seconds
from cohort_grpo.rewards.completions import completion_text
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.rollout.layout import Layout
from cohort_grpo.parallel.distributed import SilentMetrics, silent
from cohort_grpo.telemetry.health import LearningHealth
from cohort_grpo.telemetry.metrics import MetricsLogger, rollout_attention_pairs, throughput_metrics
from cohort_grpo.telemetry.progress import PHASES, Progress

# The reward function whose score > 0 counts a correct answer where the rows' task has no verifier: the
# built-in one and TRL's are named so (1.0 correct, 0.0 wrong, None when the gold answer cannot be read).
ACCURACY_REWARD = "accuracy_reward"


def allocator_retries(device: torch.device) -> int:
    """How many times the CUDA caching allocator has retried an allocation after emptying its cache."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0


def success_rate(batch: Batch, task=None) -> float | None:
    """Fraction of completions that solve their problem by the task's verifier; None when the rows' task has
    no verifier (`StepReport` then counts them by the rewards: `success_measure`)."""
    if task is not None and hasattr(task, "is_correct"):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in batch.completions]
        return float(np.mean([task.is_correct(t, r) for t, r in zip(texts, batch.rows)]))
    return None


@dataclass(frozen=True)
class SuccessMeasure:
    """What the step line's success column counts: its name on the line, and the legend's definition."""

    label: str  # "Success" where it counts correct answers, "Reward>0" where it cannot
    meaning: str


def success_measure(verified: bool, reward_names: list[str]) -> SuccessMeasure:
    """The task's verifier where there is one, else the accuracy reward where one is among the rewards, else
    the share of completions rewarded above 0 (which a format reward alone fills: not called success)."""
    if verified:
        return SuccessMeasure("Success", "completions the task's verifier grades correct")
    if ACCURACY_REWARD in reward_names:
        return SuccessMeasure("Success", f"completions {ACCURACY_REWARD} scores above 0 (correct answers)")
    return SuccessMeasure("Reward>0", "completions whose total reward is above 0 (no verifier or "
                                      f"{ACCURACY_REWARD} counts correct answers here)")


def scored_counts(batch: Batch, reward_names: list[str]) -> dict[str, int]:
    """How many of the batch's samples each reward metric's mean is over: `reward` over those some function
    scored, `rewards/<name>/*` over those that function scored (the others returned None or failed)."""
    if batch.per_function is None:
        return {}
    scored = ~torch.isnan(batch.per_function)
    counts = {"reward": int(scored.any(dim=1).sum())}
    for j, name in enumerate(reward_names):
        counts[f"rewards/{name}/mean"] = counts[f"rewards/{name}/std"] = int(scored[:, j].sum())
    return counts


def rewarded_rate(batch: Batch, reward_names: list[str]) -> float:
    """`success` without a verifier: the share of the completions `accuracy_reward` scored that it scored
    above 0 (0 when it scored none), else the share whose total reward is above 0."""
    if ACCURACY_REWARD in reward_names and batch.per_function is not None:
        scores = batch.per_function[:, reward_names.index(ACCURACY_REWARD)]
        scored = ~torch.isnan(scores)
        return float((scores[scored] > 0).float().mean()) if bool(scored.any()) else 0.0
    return float((batch.rewards > 0).float().mean())


def empty_ratio(batch: Batch) -> float:
    """Share of the completions with no text but white space (the model ended them at once)."""
    return float(np.mean([not completion_text(c).strip() for c in batch.completions])) if batch.completions else 0.0


@dataclass
class StepContext:
    """What a step's record needs from the rest of the run, passed explicitly."""

    success: float | None  # `success_rate` of the batch: None without a verifier (counted by the rewards)
    learning_rate: float
    uses_reference: bool  # β > 0: the KL is reported
    micro_rows: int  # the training micro-batch size (token counts of the forward passes)
    layout: Layout  # how the passes lay the rollout out (prompt tokens and attention pairs computed)
    reward_names: list[str]
    counters: dict[str, float] = field(default_factory=dict)  # skipped_steps, oom_retries, ...
    extra: dict[str, float] = field(default_factory=dict)  # e.g. curriculum/stage


class StepReport:
    def __init__(self, args, *, model, device: torch.device, parallel, metrics, progress, log):
        self.args, self.model, self.device, self.parallel = args, model, device, parallel
        self.metrics, self.progress, self.log = metrics, progress, log
        self.history: list[dict] = []
        self.phase_times: dict[str, float] = {}
        self.phase_peaks: dict[str, float] = {}  # GiB, CUDA only
        self.gc_mark = collector_seconds()  # the garbage collector's pauses so far (each step logs its own)
        self.alloc_retry_mark = allocator_retries(device)  # likewise the CUDA allocator's retries
        self.health = LearningHealth.from_config(args)
        self.unlogged_warnings: list[str] = []  # given at a step metrics.jsonl did not log: on its next line
        self.measure: SuccessMeasure | None = None  # what the success column counts, once the legend said it

    def resumed(self, history: list[dict]) -> None:
        """A resumed run's report: the checkpoint's per-step records, and the learning-health checks where those
        steps left them (a warning given then is not given again; one given at a step metrics.jsonl did not log
        still goes on its next line), so the resumed run warns as the uninterrupted one does."""
        self.history, self.health, self.unlogged_warnings = history, LearningHealth.from_config(self.args), []
        for record in history:
            step = int(record["step"])
            self.unlogged_warnings += self.health.observe(record)
            if self.logged_step(step):
                self.unlogged_warnings = []

    def logged_step(self, step: int) -> bool:
        """Whether `step`'s record is logged (every logging_steps, and the last step)."""
        return step % self.args.logging_steps == 0 or step == self.args.max_steps

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
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30  # which phase sets the peak
            self.phase_peaks[name] = max(peak, self.phase_peaks.get(name, 0.0))
        # a phase entered twice in a step (μ updates; an asynchronous rollout's wait before the weight refresh and
        # at the next step's start) counts its whole time
        self.phase_times[name] = self.phase_times.get(name, 0.0) + time.perf_counter() - started

    def restart_gc_clock(self) -> None:
        """The collection `MemoryManager.after_first_step` just ran is not the next step's pause."""
        self.gc_mark = collector_seconds()

    def record(self, step: int, batch: Batch, losses: list[dict], seconds: float, context: StepContext) -> dict:
        """The step's metrics record: logged, shown, and appended to the history."""
        G = self.args.num_generations
        grouped = batch.rewards.view(-1, G)
        lengths = batch.rollout.loss_mask.sum(dim=1).float()  # the model's tokens (TRL: tool results not counted)
        record = {"step": step}
        record.update({k: sum(d[k] for d in losses) / len(losses) for k in losses[0]})
        if not context.uses_reference:
            record.pop("kl", None)  # β = 0: no reference model, no KL to report (as TRL)
        record.update(batch.reward_metrics)
        record.update(batch.rollout_metrics or {})
        record.update(batch.teacher_metrics or {})
        record.update(context.extra)
        scored = None if batch.per_function is None else ~torch.isnan(batch.per_function).all(dim=1)
        if scored is None or bool(scored.all()):
            group_std, reward = grouped.std(dim=1), float(batch.rewards.mean())
        else:  # completions no reward function scored are no evidence: left out, as from the advantages
            group_std = torch.stack([g[k].std() if int(k.sum()) > 1 else torch.zeros(())
                                     for g, k in zip(grouped, scored.view(-1, G))])
            reward = float(batch.rewards[scored].mean()) if bool(scored.any()) else 0.0
        zero_std = torch.isclose(group_std, torch.zeros(())).float()  # all-equal groups (TRL's test)
        record.update({
            "reward": reward,
            "reward_std": float(group_std.mean()),
            "frac_reward_zero_std": float(zero_std.mean()),
            "informative": float(1 - zero_std.mean()),
            "success": rewarded_rate(batch, context.reward_names) if context.success is None else context.success,
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(np.mean([r == "length" for r in batch.rollout.finish_reasons])),
            "completions/empty_ratio": empty_ratio(batch),
            "learning_rate": context.learning_rate,
            "num_iterations": len(losses),
            **context.counters,
            "step_time": seconds,
        })
        record.update(self.throughput(batch, lengths, len(losses), context))
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
        # every rank's numbers averaged: global means (those over the scored samples weighted by their counts)
        record = self.parallel.mean_metrics(record, counts=scored_counts(batch, context.reward_names))
        self.history.append(record)
        warnings = self.health.observe(record)
        self.unlogged_warnings += warnings
        logged = self.logged_step(step)
        if logged:
            self.metrics.log(step, {**record, "warnings": self.unlogged_warnings} if self.unlogged_warnings else record)
            self.unlogged_warnings = []
        if step == 1 or step % self.args.log_completions_steps == 0:
            self.metrics.log_completions(step, completion_samples(batch, context.reward_names))
        self.show(step, record, success_measure(context.success is not None, context.reward_names), warnings, logged)
        return record

    def show(self, step: int, record: dict, measure: SuccessMeasure, warnings: list[str], logged: bool) -> None:
        """The step's line (printed on the first step and the logged ones: `logged`); before it the legend, the
        first time and whenever the success column changes what it counts (a curriculum stage without a
        verifier); after it the step's learning-health warnings, whatever the step."""
        if measure != self.measure:
            self.measure = measure
            self.log(f"Legend: Loss = the loss optimised (near 0 by design when μ_iters = 1); {measure.label} = share "
                     f"of the step's {measure.meaning}; μ_iters = policy updates on each rollout")
        self.progress.step_done(step, f"Step {step}/{self.args.max_steps}: Loss={record['loss']:.4f}, "
                                      f"{measure.label}={100 * record['success']:.2f}%, "
                                      f"μ_iters={record['num_iterations']}", shown=logged)
        for line in warnings:
            self.log(line)

    def throughput(self, batch: Batch, lengths: torch.Tensor, updates: int, context: StepContext) -> dict:
        """Tokens/s per phase, peak memory and MFU (cohort_grpo/telemetry/metrics.py), over all ranks.

        Prompt tokens as the forward passes see them: once per group when the group shares its
        prompt; attention's (query, key) pairs per layer, for each sliding window the layers use."""
        pairs = rollout_attention_pairs(self.model, context.layout, batch.prompt_ids,
                                        [int(n) for n in lengths.tolist()], context.micro_rows, batch.images)
        prompt_tokens, completion_tokens, *summed_pairs = (int(n) for n in self.parallel.all_reduce_sums(
            [context.layout.computed_prompt_tokens(batch.prompt_ids, context.micro_rows, batch.images),
             float(lengths.sum()), *map(float, pairs.values())]))
        record = throughput_metrics(
            self.model, self.device, self.phase_times, prompt_tokens, completion_tokens, updates,
            logprob_passes=int(self.args.num_iterations > 1) + int(context.uses_reference),
            attention_pairs=dict(zip(pairs, summed_pairs)))
        if record.get("mfu") is not None:
            record["mfu"] /= self.parallel.world_size  # MFU per GPU
        self.progress.show_rates(self.phase_times, {  # the phase bars' rates
            "sampling": (completion_tokens, "tok"), "rewards": (len(batch.rows), "seq"),
            "update": ((prompt_tokens + completion_tokens) * updates, "tok")})
        return record

    def log_iteration_summary(self, step: int, final: bool = False) -> None:
        """Algorithm 1's outer iteration (ref_reset_steps steps) in one line: loss, success (by the step line's
        name for it), reward."""
        M = self.args.ref_reset_steps or self.args.max_steps
        recent = self.history[-((step - 1) % M + 1 if final else M):] if self.history else []
        if not recent:
            return
        iteration = (recent[0]["step"] - 1) // M + 1
        label = (self.measure or SuccessMeasure("Success", "")).label.lower()
        self.log(f"Iteration {iteration}: avg loss={np.mean([r['loss'] for r in recent]):.4f}, "
                 f"{label}={100 * np.mean([r['success'] for r in recent]):.2f}%, "
                 f"avg reward={np.mean([r['reward'] for r in recent]):.4f}")


def open_step_report(args, *, model, device: torch.device, parallel, log) -> StepReport:
    """The run's `StepReport`. Rank 0 alone writes the metrics files, shows progress and logs, through `log`
    (`print` becomes the display's own, which prints above its bars); the other ranks get silent ones, so
    every rank runs the same code."""
    if not parallel.is_main:
        return StepReport(args, model=model, device=device, parallel=parallel, metrics=SilentMetrics(),
                          progress=Progress(0, True, open(os.devnull, "w")), log=silent)
    metrics = MetricsLogger(args.output_dir, args.report_to, config=args.to_dict())
    progress = Progress(args.max_steps, quiet=args.quiet)
    return StepReport(args, model=model, device=device, parallel=parallel, metrics=metrics, progress=progress,
                      log=progress.print if log is print else log)


def completion_samples(batch: Batch, reward_names: list[str], limit: int = 8) -> list[dict]:
    """The first `limit` completions with their prompt, each reward function's score, reward and advantage.
    Per-token advantages (PPO's GAE) are shown as each completion's mean."""
    advantages = batch.advantages
    if advantages.dim() == 2:
        mask = batch.rollout.completion_mask.float()
        advantages = (advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    rows = []
    for i in range(min(limit, len(batch.rows))):
        scores = batch.per_function[i].tolist()
        rows.append({"prompt": (batch.sampled_prompts or batch.prompts)[i], "completion": batch.completions[i],
                     "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(reward_names, scores)},
                     "reward": float(batch.rewards[i]), "advantage": float(advantages[i])})
        for column, value in (batch.reward_extras[i] if batch.reward_extras else {}).items():
            rows[-1][column if column not in rows[-1] else f"extra/{column}"] = value  # TRL's log_extra
    return rows
