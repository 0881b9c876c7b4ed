"""Callbacks and trainer state as transformers' `Trainer` has them, so a TRL user's callbacks run.

`trainer.state` is a transformers `TrainerState` (`global_step`, `max_steps`, `log_history`, ...);
`callbacks=[...]` takes transformers `TrainerCallback`s (or any object with some of their `on_*`
methods), called with transformers' arguments: `(args, state, control, **kwargs)`, the kwargs being
`model`, `processing_class`, `optimizer`, `lr_scheduler`, and `logs` / `metrics` where the event has
them. A callback that sets `control.should_training_stop` ends the run after that step, with the
final model and summary written as at the last step.
"""

from __future__ import annotations

from transformers import TrainerControl, TrainerState

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_step_begin", "on_step_end", "on_log", "on_save",
          "on_evaluate")


class CallbackHandler:
    def __init__(self, callbacks, args, objects: dict):
        self.callbacks = [c() if isinstance(c, type) else c for c in (callbacks or [])]
        self.args, self.objects = args, objects  # model, processing_class, optimizer, lr_scheduler
        self.state = TrainerState(max_steps=args.max_steps, logging_steps=args.logging_steps,
                                  eval_steps=args.eval_steps, save_steps=args.save_steps,
                                  train_batch_size=args.per_device_train_batch_size, log_history=[])
        self.control = TrainerControl()

    def add(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback):
        """Remove a callback (an instance, or the first of a class) and return it, as transformers does."""
        for c in self.callbacks:
            if c is callback or (isinstance(callback, type) and isinstance(c, callback)):
                self.callbacks.remove(c)
                return c
        return None

    def event(self, name: str, **kwargs) -> TrainerControl:
        """Call `name` on every callback that has it; a callback may return a new control."""
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, **self.objects, **kwargs)
            if isinstance(result, TrainerControl):
                self.control = result
        return self.control
