"""`GRPOTrainer`: DeepSeekMath Algorithm 1, with the loop in `train()` on one screen.

    for step in 1..max_steps:
        every M steps:        π_ref ← π_θ                            (outer iteration)
        sample a prompt batch
        π_old ← π_θ;  sample G completions per prompt from π_old    (cohort_grpo/rollout/)
        score each completion with the reward functions r_φ          (cohort_grpo/rewards/)
        A_i = (r_i − mean(group)) / (std(group) + eps)               (advantages.group_advantages)
        with a teacher: A_t += c·(log π_teacher − log π_old) per token  (on-policy distillation, update/teacher.py)
        μ times: update π_θ on the clipped surrogate − β·KL          (cohort_grpo/update/, objectives.policy_loss)
        update r_φ by continuous training with replay                (learned reward models only)

The trainer keeps the stages that cohort_grpo/run/assembly.py builds and calls them; each takes its inputs and
returns its result: `PromptStream` (the data order), `RolloutSource` (the rollout: sampled now or ahead, here or on
sampling ranks), `RewardRunner`, `PolicyUpdate`, `MemoryManager` (everything memory), `StepReport` (metrics and
display), `RunLifecycle` (signals, when to save) and `Checkpointing` (saving, resuming, the last step kept). The
methods of transformers' `Trainer` a TRL script calls (`save_model`, `save_state`, `push_to_hub`, ...) close the
class: each a delegation to the room that does the work, kept here so that the class owns every field it reads.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from transformers.trainer_utils import TrainOutput

from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.config.trl_names import check_trainer_keywords
from cohort_grpo.eval.held_out import HeldOutEvaluation
from cohort_grpo.rewards.batch_rewards import add_rewards, learned_reward_models, train_reward_models
from cohort_grpo.rewards.model import warm_up_reward_models
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.run.assembly import assemble_run
from cohort_grpo.run.callbacks import CallbackHandler
from cohort_grpo.run.checkpoint import RunState
from cohort_grpo.run.checkpoint_load import data_position
from cohort_grpo.run.checkpointing import Checkpointing
from cohort_grpo.run import hub
from cohort_grpo.run.ending import release_run, report_end, save_policy_folder, train_output
from cohort_grpo.run.failure import StepEnd, discard_unused_output_dir, fail_together
from cohort_grpo.run.lifecycle import RunLifecycle, claim_output_dir, resuming
from cohort_grpo.tasks.data import row_origins
from cohort_grpo.telemetry import results
from cohort_grpo.telemetry.step_report import StepContext, success_rate
from cohort_grpo.tools.toolbox import make_toolbox
from cohort_grpo.update.reference import ReferencePolicy
from cohort_grpo.run.determinism import run_determinism
from cohort_grpo.trainer.dynamic_sampling import refill_informative
from cohort_grpo.algorithm.advantages import group_advantages


class GRPOTrainer:
    def __init__(self, model, reward_funcs=None, train_dataset=None, args: GRPOConfig | None = None,
                 processing_class=None, eval_dataset=None, task=None, log=print, peft_config=None, callbacks=None,
                 tools=None, environment_factory=None, sampler_factory=None, teacher_model=None,
                 reward_processing_classes=None, optimizers=(None, None), quantization_config=None, rollout_func=None):
        if isinstance(train_dataset, GRPOConfig) and not isinstance(args, GRPOConfig):
            # TRL's positional order, GRPOTrainer(model, reward_funcs, args, train_dataset): the config is never data
            train_dataset, args = args, train_dataset
        # The raw values checked before anything loads, on a copy: the caller's config is never changed.
        self.args = args = (args or GRPOConfig()).validate()
        check_trainer_keywords(optimizers=optimizers, quantization_config=quantization_config, rollout_func=rollout_func)
        self.reward_processing_classes = reward_processing_classes  # TRL's: the tokenizer each reward model reads
        # A benchmark or test samples with its own engine through this; None: cohort_grpo.rollout.make_sampler.
        self.sampler_factory = sampler_factory
        # A run that fails before its first step leaves no folder behind (when it made the folder).
        self.new_output_dir = not Path(args.output_dir).exists()
        self.step = 0
        self.log = log  # what the stages log through while they are built; the display's once it exists
        try:
            # Tools the model may call while sampling (TRL's `tools` / `environment_factory`).
            self.toolbox = make_toolbox(tools, environment_factory, args, task)
            self.build(model, reward_funcs, train_dataset, args, processing_class, eval_dataset, task, log,
                       peft_config, teacher_model)
        except BaseException:
            self.discard_unused_output_dir()
            raise
        # transformers' TrainerState and TrainerCallbacks (cohort_grpo/run/callbacks.py).
        self.callback_handler = CallbackHandler(callbacks, self.args, dict(
            model=self.model, processing_class=self.tokenizer, optimizer=self.optimizer,
            lr_scheduler=self.scheduler))
        self.callback_handler.event("on_init_end")

    def build(self, model, reward_funcs, train_dataset, args, processing_class, eval_dataset, task, log,
              peft_config, teacher_model=None) -> None:
        """The stages of the run, each given what it needs (cohort_grpo/run/assembly.py), kept here."""
        self.task = task
        parts = assemble_run(model, args, reward_funcs=reward_funcs, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, task=task,
                             toolbox=self.toolbox, peft_config=peft_config, sampler_factory=self.sampler_factory,
                             next_prompts=self.next_prompts, log=log, stage_log=self.log_line,
                             teacher_model=teacher_model, reward_processing_classes=self.reward_processing_classes)
        self.args, self.parallel, self.device = parts.args, parts.parallel, parts.device
        self.model, self.tokenizer, self.pad_id = parts.model, parts.tokenizer, parts.pad_id
        self.eval_rows, self.prompts = parts.eval_rows, parts.prompts  # prompts.rows: the training rows in use
        self.curriculum, self.rewards = parts.curriculum, parts.rewards
        self.train_model, self.optimizer, self.scheduler = parts.train_model, parts.optimizer, parts.scheduler
        self.uses_reference, self.ref_model, self.loss_spec = parts.uses_reference, parts.ref_model, parts.loss_spec
        self.layout, self.sampler_correction = parts.layout, parts.sampler_correction
        self.sampler, self.group_sampler, self.rollouts = parts.sampler, parts.group_sampler, parts.rollouts
        self.memory, self.policy_update, self.engine_copy = parts.memory, parts.policy_update, parts.engine_copy
        self.teacher = parts.teacher  # on-policy distillation's π_teacher (cohort_grpo/update/teacher.py), or None
        self.reference = ReferencePolicy(self.model, self.ref_model, self.uses_reference, self.memory.reference_pass,
                                         self.policy_update.logprobs)
        self.report, self.log = parts.report, parts.report.log
        self.checkpoints = Checkpointing.of_run(parts, self.extra_checkpoint_state, self.load_extra_checkpoint_state)
        held_out_task = task if task is None or self.curriculum is None else self.curriculum.held_out_task()
        self.evaluation = HeldOutEvaluation(
            self.eval_rows, held_out_task, self.parallel, self.sampler, self.tokenizer,
            getattr(self.group_sampler, "encode_prompt", None), self.toolbox, self.sample, self.add_rewards,
            self.prompts.unchanged, max_new_tokens=self.args.max_completion_length,
            prompts_per_call=self.args.prompts_per_step, group_size=self.args.num_generations, pad_id=self.pad_id,
            images=getattr(self.group_sampler, "images", None))
        self.accuracy_before = self.accuracy_after = None
        self.seconds_before = 0.0  # training time of the attempts a resumed run continues
        if self.group_sampler is not None:  # every training row renders and fits, found before step 1
            rows = self.prompts.rows
            self.group_sampler.check_prompt_lengths(rows, "train_dataset", row_origins(self.args, rows), self.log)

    # ---- Algorithm 1 -------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Run Algorithm 1 for max_steps steps. resume_from_checkpoint as in transformers: True continues the newest
        checkpoint in output_dir, a path that checkpoint, None what args say (--resume). Returns transformers'
        `TrainOutput`; the per-step records are `trainer.history`."""
        args = self.claim_output_dir(resume_from_checkpoint)  # an earlier run there: resumed, replaced or refused
        self.started = time.perf_counter()
        with (self.lifecycle() as run,  # signals, checkpoints; a failed run's last completed step kept
              run_determinism(self.device, args.cpu_threads, args.full_determinism),  # same sums, busy or not
              self.teardown()):  # the stages closed on the way out
            self.resume(run)  # --resume: continue from the newest complete checkpoint, exactly
            self.callback_handler.event("on_train_begin")
            if self.step == 0:
                self.accuracy_before = self.evaluate_held_out()
                self.warm_up_reward_models()  # r_φ: offline training on the initial policy's labelled samples
            for step in self.steps():
                if self.new_iteration(step):
                    self.reset_reference()  # π_ref ← π_θ
                batch = self.rollouts.take(step)  # π_old ← π_θ (async: max_staleness ago); G per prompt
                self.score(batch)  # rewards r_φ(q, o_i)
                batch = self.refill_uninformative(batch)  # DAPO dynamic sampling (off by default)
                batch.old_logp, batch.ref_logp = self.reference_logprobs(batch)  # log π_old (μ > 1), log π_ref (β > 0)
                batch.advantages = self.estimate_advantages(batch)  # A_i = (r_i − mean) / (std + eps)
                batch.advantages, batch.teacher_metrics = self.distil(batch)  # A_t += c·(log π_teacher − log π_old)
                losses = [self.update(batch) for _ in range(args.num_iterations)]  # μ policy updates
                self.update_reward_models(batch)  # r_φ: continuous training with replay (learned r_φ only)
                self.end_step(run, batch, losses)  # rollouts.after_update, the record, evaluation, checkpoint
            self.finish()
        return self.train_output()

    @contextlib.contextmanager
    def teardown(self):
        """Around the loop: the stages closed on the way out; on a failure before the first step, the output folder
        this run made removed."""
        try:
            yield
        except BaseException:
            self.discard_unused_output_dir()
            raise
        finally:
            self.rollouts.close()  # a producer thread, and what it was sampling; the sampling ranks
            self.memory.close()  # a later run in this process can reclaim this run's objects

    def claim_output_dir(self, resume_from_checkpoint: bool | str | None) -> GRPOConfig:
        """args with transformers' `resume_from_checkpoint` folded in; an earlier run in output_dir is then resumed,
        replaced (a finished one, as TRL) or refused (an unfinished one) before anything trains."""
        self.args = self.callback_handler.args = resuming(self.args, resume_from_checkpoint)
        claim_output_dir(self.args, self.log)
        return self.args

    def train_output(self) -> TrainOutput:
        """transformers' `TrainOutput` of this call of train(): steps, mean loss, runtime and throughputs."""
        args, ranks = self.args, self.parallel.world_size
        return train_output(self.history, steps_run=self.step - self.first_step + 1,
                            seconds=time.perf_counter() - self.started,
                            completions_per_step=args.generation_batch_size * ranks,
                            steps_per_epoch=len(self.prompts.rows) / (args.prompts_per_step * ranks))

    # ---- the steps of the loop ---------------------------------------------------------------
    def steps(self):
        """The steps still to run (after a checkpoint's, on resume); each starts the step's clock. A
        callback that sets `control.should_training_stop` ends the loop after its step."""
        for step in range(self.step + 1, self.args.max_steps + 1):
            if self.callback_handler.control.should_training_stop:
                return
            self.step, self.step_started = step, time.perf_counter()
            self.callback_handler.event("on_step_begin")
            yield step

    def new_iteration(self, step: int) -> bool:
        """An outer iteration of Algorithm 1 starts every ref_reset_steps (M) steps."""
        every = self.args.ref_reset_steps
        return bool(every) and step > 1 and (step - 1) % every == 0

    def reset_reference(self) -> None:
        """π_ref ← π_θ (cohort_grpo/update/reference.py)."""
        self.reference.reset(self.optimizer)
        self.report.log_iteration_summary(self.step)

    def next_prompts(self) -> list[dict]:
        """This rank's block of the next prompt batch (a curriculum switches the source at its stages)."""
        self.enter_curriculum_stage(self.step)
        return self.parallel.shard(self.prompts.next_rows())

    def sample(self, rows: list[dict]) -> Batch:
        """`rows` sampled now from the current policy on this rank's engine, G completions each (dynamic
        sampling's extra rounds, the reward models' warm-up); a step's own rollout is `self.rollouts.take`'s."""
        return self.rollouts.sample(rows)

    def score(self, batch: Batch) -> None:
        """Each completion's reward (weighted sum of the reward functions; DAPO's overlong penalty added)."""
        with self.report.phase("rewards"), fail_together(self.parallel, f"scoring step {self.step}"):
            self.add_rewards(batch)  # every rank fails alike, so that they save the last step together

    def add_rewards(self, batch: Batch) -> None:
        """The batch's rewards from the run's reward functions (cohort_grpo/rewards/batch_rewards.py)."""
        add_rewards(self.rewards, batch, self.args, trainer_state=self.state)

    def refill_uninformative(self, batch: Batch) -> Batch:
        """DAPO dynamic sampling: swap all-equal-reward groups for freshly sampled informative ones."""
        if not self.args.dynamic_sampling:
            return batch
        with self.report.phase("resampling"):
            return refill_informative(batch, lambda: self.sample_and_score(self.next_prompts()), self.args, self.pad_id)

    def sample_and_score(self, rows: list[dict]) -> Batch:
        batch = self.sample(rows)
        self.add_rewards(batch)
        return batch

    def reference_logprobs(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(log π_old, log π_ref), each [B, T] or None: π_old's only when μ > 1 (at μ = 1, π_old = π_θ
        and ρ ≡ 1) or when a sequence-level sampler correction needs it up front, π_ref's only when β > 0."""
        with self.report.phase("logprobs"):
            needs_old = self.args.num_iterations > 1 or self.loss_spec.sequence_correction
            old = self.policy_update.logprobs(self.model, batch) if needs_old else None
            return old, self.reference.logprobs(batch)

    def estimate_advantages(self, batch: Batch) -> torch.Tensor:
        """GRPO's group-relative advantages, [B] (PPO's trainer supplies GAE's per-token ones instead).
        A completion that no reward function scored (its row of `batch.per_function` all NaN) is left out
        of its group's mean and std and gets 0, as in TRL 1.16."""
        scored = None if batch.per_function is None else ~torch.isnan(batch.per_function).all(dim=1)
        return group_advantages(batch.rewards, self.args.num_generations, self.args.scale_rewards, scored=scored)

    def distil(self, batch: Batch) -> tuple[torch.Tensor, dict | None]:
        """On-policy distillation (teacher_model): the advantages with each sampled token's
        c·(log π_teacher − log π_old) added, [B, T], and the distillation/* metrics; as they were without a teacher."""
        if self.teacher is None:
            return batch.advantages, None
        with self.report.phase("logprobs"):
            return self.teacher(batch)

    def update(self, batch: Batch) -> dict:
        """One policy update (μ of these per rollout); its statistics."""
        with self.report.phase("update"):
            return self.update_step(batch)

    def update_step(self, batch: Batch) -> dict:  # PPO's trainer adds its critic's step
        return self.policy_update(batch, self.step)

    def update_reward_models(self, batch: Batch) -> None:
        """Algorithm 1, last line: each learned reward model r_φ (a reward function with `on_step_end`)
        trains on this step's samples with replay; its rm/* metrics join the step's record."""
        if learned_reward_models(self.rewards.funcs):
            with self.report.phase("reward_model"):
                train_reward_models(self.rewards.funcs, batch, self.args.num_generations, self.step)

    def end_step(self, run: RunLifecycle, batch: Batch, losses: list[dict]) -> None:
        """After the algorithm's lines: the engine's weights, the record, evaluation, the checkpoint."""
        self.rollouts.after_update(self.model)  # the engine's copy refreshed (FSDP2); what is sampled ahead started
        self.state.global_step = self.step  # counted before its record is logged, as transformers' Trainer does
        record = self.log_step(batch, losses, time.perf_counter() - self.step_started)
        if self.step == self.first_step:  # the run's long-lived objects exist now
            self.memory.after_first_step()  # full collections stop walking them (cohort_grpo/memory/gc_pauses.py)
            self.report.restart_gc_clock()
        control = self.callback_handler.event("on_step_end")  # then on_log, evaluate, save: transformers' order
        if self.report.logged_step(self.step) or control.should_log:
            control.should_log = False
            control = self.callback_handler.event("on_log", logs=record)
        due = self.args.eval_steps and self.step % self.args.eval_steps == 0 and (
            self.step < self.args.max_steps or self.task is None)  # a task's last evaluation is finish()'s
        if due or control.should_evaluate:
            control.should_evaluate = False
            self.evaluate()
        if control.should_save:
            control.should_save = False
            run.save_once(self.step)
        run.end_of_step(self.step, self.policy_update.counters.nonfinite_in_a_row)

    def log_step(self, batch: Batch, losses: list[dict], seconds: float) -> dict:
        """The step's metrics record (cohort_grpo/telemetry/step_report.py)."""
        task = self.curriculum.task if self.curriculum is not None else self.task  # the rows' own task
        context = StepContext(
            success=success_rate(batch, task), learning_rate=self.scheduler.get_last_lr()[0],
            uses_reference=self.uses_reference, micro_rows=self.memory.micro_rows, layout=self.layout,
            reward_names=self.rewards.names,
            counters={"skipped_steps": self.policy_update.counters.skipped_steps,
                      "oom_retries": self.memory.oom_retries},
            extra=self.curriculum.metrics() if self.curriculum is not None else {})
        record = self.report.record(self.step, batch, losses, seconds, context)
        self.state.log_history.append(record)
        return record

    # ---- around the loop ---------------------------------------------------------------------
    def lifecycle(self) -> RunLifecycle:
        """The run around the loop: signals, resume, checkpoints (cohort_grpo/run/lifecycle.py)."""
        return RunLifecycle(self.args, self.parallel, self.log, self.save_checkpoint, self.close_logs, self.step_end)

    def resume(self, run: RunLifecycle | None = None) -> None:
        """Load the checkpoint --resume / resume_from_checkpoint names into this trainer (`train()`
        does; call it yourself to inspect a checkpoint's state without training)."""
        state = self.checkpoints.resume(run or self.lifecycle(), lambda: self.rewards.funcs, self.enter_curriculum_stage)
        if state is not None:  # the objects are restored in place; the plain values are the trainer's
            self.step, self.accuracy_before, self.seconds_before = state.step, state.accuracy_before, state.seconds
            self.report.resumed(state.history)  # the records, and the learning-health checks where they left them
            self.state.log_history = [dict(r) for r in state.history]
            self.prompts.load_state_dict(data_position(state.prompts, state.step, len(self.prompts.rows), self.log))
            counters = self.policy_update.counters
            counters.skipped_steps, counters.nonfinite_in_a_row = state.skipped_steps, state.nonfinite_in_a_row
            self.state.global_step = self.step
        self.first_step = self.step + 1

    def save_checkpoint(self, step_end: StepEnd | None = None) -> Path:
        """checkpoint-<step> of the run as it is now, or with `step_end`: of the step it noted, with the weights
        as they are now (a failure in the next step, before its update: cohort_grpo/run/failure.py), and the rollouts
        sampled ahead as they stood then."""
        with self.rollouts.as_of(None if step_end is None else step_end.sampled_ahead):
            folder = self.checkpoints.save(self.args, self.rewards.funcs, self.run_state, step_end)
        self.callback_handler.event("on_save")
        return folder

    def run_state(self) -> RunState:
        """The run's plain values now (`RunState`); its history is the run's list up to its length now."""
        counters = self.policy_update.counters
        prompts = {**self.prompts.state_dict(), "rows": len(self.prompts.rows)}
        return RunState(step=self.step, prompts=prompts, history=self.history,
                        history_length=len(self.history),
                        accuracy_before=self.accuracy_before, skipped_steps=counters.skipped_steps,
                        nonfinite_in_a_row=counters.nonfinite_in_a_row, seconds=self.training_seconds())

    def step_end(self) -> StepEnd:
        """The run at the end of a step, noted for the checkpoint a failure in the next step writes."""
        steps = self.policy_update.optimizer_steps()
        return self.checkpoints.note_step_end(self.run_state(), self.args, self.rewards.funcs, steps,
                                              self.rollouts.sampled_ahead())

    def extra_checkpoint_state(self) -> dict | None:
        """State beyond the model, optimizer and data order: the rollouts sampled ahead (asynchronous
        rollouts: `RolloutSource.state_dict`, a collective), a subclass's own (PPO's critic); None: nothing to add."""
        return self.rollouts.state_dict()

    def load_extra_checkpoint_state(self, state: dict) -> None:
        """Restore what `extra_checkpoint_state` saved."""
        self.rollouts.load_state_dict(state)

    def enter_curriculum_stage(self, step: int) -> None:
        """At a stage boundary: that stage's rows (and reward functions): cohort_grpo/tasks/curriculum.py."""
        if self.curriculum is not None:
            self.rewards = self.curriculum.switch(step, self.tokenizer, self.prompts, self.rewards, self.log)

    def warm_up_reward_models(self) -> None:
        """r_φ's offline warm-up on the initial policy's samples; the run's data order and seeds are kept."""
        with self.prompts.unchanged():
            warm_up_reward_models(self.rewards.funcs, self.args, self.prompts.rows, self.sample, self.log)

    def evaluate(self) -> dict[str, float]:
        """On eval_dataset, as TRL: the task's verifier's `eval/*` or the run's reward functions' `eval_*`
        (cohort_grpo/eval/held_out.py); logged and passed to the callbacks' `on_evaluate`; empty without rows."""
        if not self.eval_rows:
            return {}
        self.rollouts.wait_for_engine()  # a rollout sampled ahead on this rank's engine finishes first
        with self.report.phase("eval"):
            metrics, line = self.evaluation(self.step, self.rewards.names)
        self.report.metrics.log(self.step, metrics)
        self.state.log_history.append({**metrics, "step": self.step})
        self.callback_handler.event("on_evaluate", metrics=metrics)
        self.log(line)
        return metrics

    def evaluate_held_out(self) -> float | None:
        """Before and after training: the task's greedy held-out accuracy (None without a task: as TRL)."""
        return self.evaluate().get("eval/accuracy") if self.task is not None else None

    def finish(self) -> None:
        """The last iteration's summary, the final held-out accuracy, the policy as a Hugging Face
        folder, summary.json (its seconds summed over the attempts of a resumed run): cohort_grpo/run/ending.py."""
        self.report.log_iteration_summary(self.step, final=True)
        self.accuracy_after = self.evaluate_held_out()
        out = self.save_model(self.args.output_dir)
        release_run(self.rollouts, self.sampler, self.parallel, self.memory)
        self.callback_handler.event("on_train_end")
        report_end(out, self.args, parallel=self.parallel, accuracy_before=self.accuracy_before,
                   accuracy_after=self.accuracy_after, seconds=self.training_seconds(), steps=self.step,
                   history=self.history, warnings=self.report.health.lines, held_out_rows=self.eval_rows,
                   close_logs=self.close_logs, close_display=self.report.progress.close, log=self.log)

    def training_seconds(self) -> float:
        """Seconds spent in train() so far, the earlier attempts of a resumed run included."""
        return self.seconds_before + time.perf_counter() - self.started

    def close_logs(self) -> None:
        self.report.metrics.close()
        self.report.progress.close()

    def discard_unused_output_dir(self) -> None:
        """Remove the output folder this run made, if it failed before finishing a step."""
        report = getattr(self, "report", None)
        discard_unused_output_dir(self.args.output_dir, made_by_run=self.new_output_dir,
                                  step_done=report is not None and bool(self.history),
                                  close_logs=None if report is None else self.close_logs)

    def log_line(self, line: str) -> None:
        """What the stages built before the display exists log through (the display's, once it does)."""
        self.log(line)

    # ---- transformers' Trainer methods a TRL script calls around train() (a ported script changes only its import)
    @property
    def history(self) -> list[dict]:
        """Every step's metrics record so far."""
        return self.report.history

    @property
    def state(self):
        """transformers' `TrainerState`: global_step, max_steps, log_history (step records and evaluations)."""
        return self.callback_handler.state

    def add_callback(self, callback) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.pop(callback)

    def is_world_process_zero(self) -> bool:
        """Whether this process is the first of the job (the one that writes files and prints)."""
        return self.parallel.is_main

    def save_model(self, output_dir: str | None = None) -> Path:
        """The policy and its tokenizer as a Hugging Face folder (TRL's), written by rank 0 (the others wait for it)."""
        out = Path(output_dir or self.args.output_dir)
        return save_policy_folder(self.model, self.tokenizer, out, self.parallel, self.args.dtype)

    def log_metrics(self, split: str, metrics: dict) -> None:
        """`metrics` printed as one block under `***** <split> metrics *****`, by the first process."""
        if self.parallel.is_main:
            results.log_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """`<split>_results.json` in output_dir, and with `combined` the metrics merged into all_results.json."""
        if self.parallel.is_main:
            results.save_metrics(self.args.output_dir, split, metrics, combined)

    def save_state(self) -> None:
        """`trainer.state` as trainer_state.json in output_dir."""
        if self.parallel.is_main:
            results.save_state(self.state, self.args.output_dir)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """The policy saved, then output_dir uploaded to the Hub (cohort_grpo/run/hub.py); `kwargs` taken, unused."""
        self.save_model()
        if not self.parallel.is_main:
            return None
        return hub.push_to_hub(self.args, commit_message=commit_message, blocking=blocking, token=token,
                               revision=revision, private=private)
