"""`GRPOTrainer`: DeepSeekMath Algorithm 1, with the loop in `train()` readable top to bottom.

    for step in 1..max_steps:
        every M steps:        π_ref ← π_θ                            (outer iteration)
        sample a prompt batch
        π_old ← π_θ;  sample G completions per prompt from π_old    (rollout)
        score each completion with the reward functions r_φ          (rewards)
        A_i = (r_i − mean(group)) / (std(group) + eps)               (advantages)
        μ times: update π_θ on the clipped surrogate − β·KL          (update)
        update r_φ by continuous training with replay                (learned reward models only)

Everything the loop calls is a short method below it; the maths lives in `algo.py`.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import checkpoint
from .algo import group_advantages, overlong_penalty, policy_loss
from .dynamic_sampling import fill_informative
from .config import GRPOConfig
from .errors import CohortError
from .logprobs import completion_logprobs, pack_prompt_completion
from .modelio import load_policy, save_policy
from .rewards.model import prepare_reward_funcs, warm_up_reward_models
from .rewards.runner import RewardRunner
from .rollout import Rollout, SamplingParams
from .engine import make_sampler
from .evaluate import evaluate
from .curriculum import Curriculum
from .tasks import prompt_text
from .metrics import MetricsLogger, throughput_metrics
from .progress import PHASES, Progress
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


class GRPOTrainer:
    def __init__(self, model, reward_funcs=None, train_dataset=None, args: GRPOConfig | None = None,
                 processing_class=None, eval_dataset=None, task=None, log=print):
        self.args = args = (args or GRPOConfig()).validate()
        self.task = task
        self.log = log
        _seed_everything(args.seed)
        checkpoint.prepare_output_dir(args, log)  # writable; an earlier run's checkpoints not overwritten by accident
        self.device = _pick_device(args.device)
        self.model, self.tokenizer = load_policy(model, processing_class, device=self.device, dtype=args.dtype, log=log,
                                                 trust_remote_code=args.trust_remote_code, impl=args.model_impl)
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
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                           betas=(args.adam_beta1, args.adam_beta2))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # β = 0 needs no reference at all: skip the copy and its forward passes.
        self.ref_model = self._frozen_copy() if args.beta > 0 else None
        self.sampler = make_sampler(self.model, self.tokenizer)
        self.data_rng = random.Random(args.seed)
        self.data_order: list[int] = []
        self.history: list[dict] = []
        self.step = 0
        self.phase_times: dict[str, float] = {}
        self.accuracy_before = self.accuracy_after = None
        self.skipped_steps = self.nonfinite_in_a_row = 0  # updates skipped for a non-finite loss / gradient
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLogger(args.output_dir, args.report_to, config=args.to_dict())
        self.progress = Progress(args.max_steps, quiet=args.quiet)
        self.log = self.progress.print if log is print else log

    # ---- Algorithm 1 -------------------------------------------------------------------------
    def train(self) -> list[dict]:
        args = self.args
        started_run = time.perf_counter()
        self.resume()  # --resume: continue from the newest complete checkpoint, exactly
        if self.step == 0:
            self.accuracy_before = self.evaluate_held_out()
            warm_up_reward_models(self)  # r_φ: offline training on the initial policy's labelled samples
        for step in range(self.step + 1, args.max_steps + 1):
            self.step = step
            started = time.perf_counter()
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
            with self.phase("reward_model"):
                self.update_reward_models(batch)  # r_φ: continuous training with replay (learned r_φ only)
            self.record_step(batch, losses, time.perf_counter() - started)
            if args.eval_steps and step % args.eval_steps == 0 and step < args.max_steps:
                self.evaluate_held_out()
            self.maybe_save_checkpoint()  # every save_steps and at the end; on SIGINT/SIGTERM save and stop
        self.log_iteration_summary(final=True)
        self.accuracy_after = self.evaluate_held_out()
        self.finish(time.perf_counter() - started_run)
        return self.history

    # ---- the steps of the loop ---------------------------------------------------------------
    def next_prompts(self) -> list[dict]:
        """The next prompts_per_step rows, walking a shuffled order of the data (epochs repeat)."""
        if self.curriculum is not None:
            self.curriculum.enter(self)  # at a stage boundary: that stage's rows (and reward functions)
        rows = []
        while len(rows) < self.args.prompts_per_step:
            if not self.data_order:
                self.data_order = list(range(len(self.train_rows)))
                self.data_rng.shuffle(self.data_order)
            rows.append(self.train_rows[self.data_order.pop()])
        return rows

    def sample_batch(self, rows: list[dict]) -> Batch:
        args, G = self.args, self.args.num_generations
        prompt_ids = [self.encode_prompt(r["prompt"]) for r in rows]
        params = SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, eos_token_ids=[self.tokenizer.eos_token_id],
            pad_token_id=self.pad_id, seed=self.data_rng.randrange(2**31),
        )
        rollout = self.sampler.generate(prompt_ids, G, params)
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

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch) -> None:
        """π_old's log-probs are needed only when μ > 1 (at μ = 1, π_old = π_θ and ρ ≡ 1)."""
        if self.args.num_iterations > 1:
            batch.old_logp = self._logprobs_no_grad(self.model, batch)
        if self.ref_model is not None:
            batch.ref_logp = self._logprobs_no_grad(self.ref_model, batch)

    def update(self, batch: Batch) -> dict:
        """One optimizer step over the whole rollout, in micro-batches (gradient accumulation)."""
        args = self.args
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = len(batch.rows)
        keep_rows = self.loss_rows(batch)
        mask_all = batch.rollout.completion_mask * keep_rows.unsqueeze(1)
        num_tokens = max(float(mask_all.sum()), 1.0) if args.loss_type == "dapo" else None
        sums: dict[str, float] = {}
        for start in range(0, total, args.per_device_train_batch_size):
            idx = slice(start, start + args.per_device_train_batch_size)
            input_ids, attention_mask, completion, mask = self._micro_batch(batch, idx)
            out = completion_logprobs(self.model, input_ids, attention_mask, completion,
                                      temperature=args.temperature or 1.0, with_entropy=True)
            width = completion.shape[1]  # the micro-batch is trimmed to its longest completion
            old = batch.old_logp[idx, :width].to(self.device) if batch.old_logp is not None else out.logp.detach()
            ref = batch.ref_logp[idx, :width].to(self.device) if batch.ref_logp is not None else None
            advantages = batch.advantages[idx] if batch.advantages.dim() == 1 else batch.advantages[idx, :width]
            loss_mask = mask * keep_rows[idx].unsqueeze(1).to(self.device)  # truncated rows out, when asked
            loss, stats = policy_loss(
                out.logp, old, advantages.to(self.device), loss_mask, ref_logp=ref, epsilon=args.epsilon,
                epsilon_high=args.epsilon_high, beta=args.beta, loss_type=args.loss_type,
                max_completion_length=args.max_completion_length, num_tokens=num_tokens,
                importance_sampling_level=args.importance_sampling_level, entropy=out.entropy,
                entropy_coef=args.entropy_coef,
            )
            # Token-level DAPO already divides by the whole batch's tokens; the others average micro-batches.
            weight = 1.0 if args.loss_type == "dapo" else completion.shape[0] / total
            (loss * weight).backward()
            stats["loss"] = float(loss.detach()) * (1.0 if args.loss_type != "dapo" else total / completion.shape[0])
            stats["entropy"] = float((out.entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v * completion.shape[0] / total
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        if checkpoint.update_is_finite(self, sums.get("loss", 0.0), grad_norm):  # NaN/inf: skip, count
            self.optimizer.step()
            self.scheduler.step()  # as transformers' Trainer: the schedule advances with real updates only
        sums["grad_norm"] = float(grad_norm)
        return sums

    def loss_rows(self, batch: Batch) -> torch.Tensor:
        """[B] 1/0: which completions enter the loss (TRL's mask_truncated_completions drops those cut at the limit)."""
        keep = torch.ones(len(batch.rows), dtype=batch.rollout.completion_mask.dtype)
        if self.args.mask_truncated_completions:
            keep = torch.tensor([r != "length" for r in batch.rollout.finish_reasons], dtype=keep.dtype)
        return keep

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
        """Load the checkpoint --resume / resume_from_checkpoint names (cohort/checkpoint.py)."""
        checkpoint.resume(self)

    def maybe_save_checkpoint(self) -> None:
        """checkpoint-<step> every save_steps and at the last step (cohort/checkpoint.py)."""
        checkpoint.maybe_save(self)

    def reset_reference(self) -> None:
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())
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

    def _micro_batch(self, batch: Batch, idx: slice):
        completion = batch.rollout.completion_ids[idx]
        mask = batch.rollout.completion_mask[idx]
        width = int(mask.sum(dim=1).max().clamp(min=1))  # trim padding columns no row uses
        completion, mask = completion[:, :width], mask[:, :width]
        input_ids, attention_mask = pack_prompt_completion(batch.prompt_ids[idx], completion, mask, self.pad_id)
        return (input_ids.to(self.device), attention_mask.to(self.device), completion.to(self.device),
                mask.to(self.device))

    def _logprobs_no_grad(self, model, batch: Batch) -> torch.Tensor:
        full = torch.zeros(batch.rollout.completion_ids.shape, dtype=torch.float32)
        model.eval()
        for start in range(0, len(batch.rows), self.args.per_device_train_batch_size):
            idx = slice(start, start + self.args.per_device_train_batch_size)
            input_ids, attention_mask, completion, mask = self._micro_batch(batch, idx)
            logp = completion_logprobs(model, input_ids, attention_mask, completion,
                                       temperature=self.args.temperature or 1.0).logp
            full[idx, : logp.shape[1]] = logp.float().cpu()
        return full

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
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with self.progress.phase(name if name in PHASES else "update"):
            yield
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.phase_times[name] = time.perf_counter() - started

    def record_step(self, batch: Batch, losses: list[dict], seconds: float) -> None:
        G = self.args.num_generations
        grouped = batch.rewards.view(-1, G)
        lengths = batch.rollout.completion_mask.sum(dim=1).float()
        record = {"step": self.step}
        record.update({k: sum(d[k] for d in losses) / len(losses) for k in losses[0]})
        if self.ref_model is None:
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
            "step_time": seconds,
        })
        prompt_tokens, completion_tokens = sum(len(p) for p in batch.prompt_ids), int(lengths.sum())
        record.update(throughput_metrics(  # tokens/s per phase, peak memory, MFU (cohort/metrics.py)
            self.model, self.device, self.phase_times, prompt_tokens, completion_tokens, len(losses),
            logprob_passes=int(self.args.num_iterations > 1) + int(self.ref_model is not None)))
        self.progress.show_rates(self.phase_times, {  # the phase bars' rates
            "sampling": (completion_tokens, "tok"), "rewards": (len(batch.rows), "seq"),
            "update": ((prompt_tokens + completion_tokens) * len(losses), "tok")})
        record.update({f"time/{k}": v for k, v in self.phase_times.items()})
        self.phase_times = {}
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

    def evaluate_held_out(self) -> float | None:
        """Greedy accuracy on the held-out rows (None without eval_dataset or a task verifier)."""
        if not self.eval_rows or self.task is None:
            return None
        with self.phase("eval"):
            result = evaluate(self.sampler, self.tokenizer, self.task, self.eval_rows, self.encode_prompt,
                              max_new_tokens=self.args.max_completion_length)
        self.metrics.log(self.step, result.metrics())
        self.log(f"eval (step {self.step}): accuracy={100 * result.accuracy:.1f}% on {result.num_questions} problems")
        return result.accuracy

    def finish(self, seconds: float) -> None:
        """Final policy as a Hugging Face folder, summary.json, and the held-out accuracy line."""
        out = Path(self.args.output_dir)
        self.save_model(out)
        summary = {"accuracy_before": self.accuracy_before, "accuracy_after": self.accuracy_after,
                   "seconds": round(seconds, 2), "steps": self.step,
                   "final_reward": self.history[-1]["reward"] if self.history else None}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.close()
        self.progress.close()
        checkpoint.finish(self)  # SIGINT / SIGTERM back to their previous handlers
        if self.accuracy_before is not None:
            self.log(f"held-out accuracy: {100 * self.accuracy_before:.1f}% -> {100 * self.accuracy_after:.1f}% "
                     f"({len(self.eval_rows)} problems)")

    def save_model(self, output_dir: str | None = None) -> Path:
        return save_policy(self.model, self.tokenizer, Path(output_dir or self.args.output_dir))


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


def _pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise CohortError(f"device {spec!r} asked for, but no CUDA GPU is available; use --device cpu")
    return torch.device(spec)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
