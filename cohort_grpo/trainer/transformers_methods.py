"""The methods of transformers' `Trainer` that a TRL script calls around `train()` (`save_model`, `save_state`,
`log_metrics`, `push_to_hub`, ...), so that a ported script's only change is its import.

`GRPOTrainer` takes them on as a base class. Each is a delegation to the room that does the work: the callbacks
and `TrainerState` (cohort_grpo/run/callbacks.py), the results files (cohort_grpo/telemetry/results.py), the
policy's Hugging Face folder (cohort_grpo/run/ending.py), the Hub (cohort_grpo/run/hub.py).
"""

from __future__ import annotations

from pathlib import Path

from cohort_grpo.run import hub
from cohort_grpo.run.ending import save_policy_folder
from cohort_grpo.telemetry import results


class TransformersTrainerMethods:
    """transformers' `Trainer` methods over a trainer's run: its `args`, `parallel`, `model`, `tokenizer`, step report
    (`report`) and callbacks (`callback_handler`)."""

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
