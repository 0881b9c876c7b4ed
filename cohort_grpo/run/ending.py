"""The end of a run: what it leaves behind and what it lets go of.

The policy is written as a Hugging Face folder by rank 0 (gathered first, a collective, where no rank
holds a whole copy); the parts that hold threads, process groups, CUDA graphs and host copies are
released in the one order that keeps each collective's partners alive; rank 0 writes summary.json,
which `cohort-grpo report` reads beside metrics.jsonl, and with --push_to_hub uploads the run; `train()` returns
transformers' `TrainOutput`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from transformers.trainer_utils import TrainOutput

from cohort_grpo.models.policy import save_policy
from cohort_grpo.parallel.colocation import gathered_state, holds_shards
from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.rollout.source import RolloutSource
from cohort_grpo.run import hub

SUMMARY_FILE = "summary.json"


def save_policy_folder(model, tokenizer, out: Path, parallel: Parallel, dtype: str) -> Path:
    """`model` and `tokenizer` as a Hugging Face folder in `out`, written by rank 0 while the other ranks wait
    for it; a model sharded over the ranks is gathered in `dtype` (the run's) first, on every rank."""
    state = None
    if holds_shards(model):  # no whole copy on any rank: gathered (a collective), in the run's dtype
        state = gathered_state(model, getattr(torch, dtype))
    if parallel.is_main:
        save_policy(model, tokenizer, out, state=state)
    parallel.barrier()
    return out


def release_run(rollouts: RolloutSource, sampler, parallel: Parallel, memory) -> None:
    """After the last collective of a run that trained to its end: the rollout source closes (what it sampled
    ahead stops; with --rollout_gpus, so do the sampling ranks), then the engine's CUDA graphs, then the process
    group; π_ref comes back from the host last, for the callbacks' `on_train_end` and the caller."""
    rollouts.close()  # with --rollout_gpus: the sampling ranks stop
    if parallel.world_size > 1 and hasattr(sampler, "release"):
        sampler.release()  # CUDA graphs that captured a group's collectives go before the group
    parallel.close()  # the last collective was the saved model's barrier
    memory.end_of_run()  # π_ref back from the host: the caller may read trainer.ref_model


def write_summary(out: Path, *, accuracy_before: float | None, accuracy_after: float | None, seconds: float,
                  steps: int, history: list[dict], warnings: list[str] = ()) -> dict:
    """summary.json in `out`: the held-out accuracy before and after, the seconds spent training (over every
    attempt of a resumed run), the steps, the last step's reward and the learning-health warnings the run printed
    (each once, in order); the summary is returned."""
    summary = {"accuracy_before": accuracy_before, "accuracy_after": accuracy_after, "seconds": round(seconds, 2),
               "steps": steps, "final_reward": history[-1]["reward"] if history else None,
               "warnings": list(dict.fromkeys(warnings))}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def report_end(out: Path, args, *, parallel: Parallel, accuracy_before: float | None, accuracy_after: float | None,
               seconds: float, steps: int, history: list[dict], warnings: list[str], held_out_rows: list | None,
               close_logs: Callable[[], None], close_display: Callable[[], None], log: Callable[[str], None]) -> None:
    """What a run that trained to its end leaves and says once its policy is saved in `out`: on rank 0, summary.json
    (`write_summary`), the logs closed, with --push_to_hub the upload, and the held-out accuracy before and after
    (over `held_out_rows`); on the other ranks, their display closed."""
    if not parallel.is_main:  # rank 0 alone writes the summary and prints
        close_display()
        return
    write_summary(out, accuracy_before=accuracy_before, accuracy_after=accuracy_after, seconds=seconds, steps=steps,
                  history=history, warnings=warnings)
    close_logs()
    if args.push_to_hub:  # as transformers: the trained policy and the run's files, at the end
        log(f"pushed {out} to the Hub: {hub.push_to_hub(args).commit_url}")
    if accuracy_before is not None:
        log(f"held-out accuracy: {100 * accuracy_before:.1f}% -> {100 * accuracy_after:.1f}% "
            f"({len(held_out_rows)} problems)")


def train_output(history: list[dict], *, steps_run: int, seconds: float, completions_per_step: int,
                 steps_per_epoch: float | None) -> TrainOutput:
    """What `train()` returns, as transformers' Trainer does: the last step, the mean loss over the run's steps and
    the `train_*` metrics of this call (`steps_run` steps in `seconds`; a sample is a completion, as a TRL batch
    counts them). `epoch`: the passes over the training rows so far (absent without rows to count)."""
    step = int(history[-1]["step"]) if history else 0
    loss = sum(record["loss"] for record in history) / len(history) if history else 0.0
    metrics = {"train_runtime": round(seconds, 4)}
    if seconds > 0:
        metrics["train_samples_per_second"] = round(steps_run * completions_per_step / seconds, 3)
        metrics["train_steps_per_second"] = round(steps_run / seconds, 3)
    metrics["train_loss"] = loss
    if steps_per_epoch:
        metrics["epoch"] = step / steps_per_epoch
    return TrainOutput(global_step=step, training_loss=loss, metrics=metrics)
