"""`TrainerMethods`: the methods of transformers' `Trainer` a TRL script calls around `train()` and `evaluate()`,
under their names and with their meanings, so that the script ports by its import alone.

Each is a short delegation: the files are cohort/telemetry/results.py's, the upload cohort/run/hub.py's, the
state and callbacks cohort/run/callbacks.py's. `GRPOTrainer` (and `PPOTrainer` through it) has them all; the
class expects the trainer's `args`, `parallel`, `report` and `callback_handler`, and its `save_model`.
"""

from __future__ import annotations

from cohort.run import hub
from cohort.telemetry import results


class TrainerMethods:
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

    def log_metrics(self, split: str, metrics: dict) -> None:
        """`metrics` printed as one block under `***** <split> metrics *****`, by the first process."""
        if self.is_world_process_zero():
            results.log_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """`<split>_results.json` in output_dir, and with `combined` the metrics merged into all_results.json."""
        if self.is_world_process_zero():
            results.save_metrics(self.args.output_dir, split, metrics, combined)

    def save_state(self) -> None:
        """`trainer.state` as trainer_state.json in output_dir."""
        if self.is_world_process_zero():
            results.save_state(self.state, self.args.output_dir)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """The policy saved to output_dir, then output_dir uploaded to the Hub repository `args.hub_model_id` (else
        the folder's name), created if missing (cohort/run/hub.py); the commit's `CommitInfo` (a `Future` of it
        with `blocking=False`), None on the other processes. transformers' model-card keywords (`kwargs`) are
        taken and unused: no model card is written."""
        self.save_model()
        if not self.is_world_process_zero():
            return None
        return hub.push_to_hub(self.args, commit_message=commit_message, blocking=blocking, token=token,
                               revision=revision, private=private)
